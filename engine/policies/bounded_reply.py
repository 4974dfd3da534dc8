"""Reading an HTTP reply from an untrusted server within a byte bound.

The one reader of both clients of OpenAI-compatible servers: the heist's policy
(engine.policies.openai_policy) and the recording proxy's upstream (engine.program.upstream).
`bounded_body(resp, limit)` yields the body as it arrives, decompressed, and stops with a
ReplyFault - which each caller words as its own error - when the reply

* announces a Content-Length over `limit` (before a byte of the body is read): ReplyTooLarge
  with `announced`;
* is more than `limit` bytes on the wire, or after decompression (a gzip bomb is cut off as
  its output passes the bound, not after it was inflated): ReplyTooLarge;
* comes in an encoding no reply may use (a request asks for gzip or deflate only):
  UnsupportedEncoding;
* is not valid compressed data: CorruptBody;
* ends before the length it announced: ShortBody;
* ends inside its compressed stream: TruncatedBody.

A failed read of the connection (OSError, http.client.HTTPException) passes as it is: whether
it is a dropped connection or a deadline that shut the socket is the caller's to tell.
"""

from __future__ import annotations

import http.client
import zlib
from collections.abc import Iterator
from typing import Any

#: The most one read asks of the connection: `read1` hands over what has arrived, up to this.
READ_CHUNK = 16 * 1024


class ReplyFault(Exception):
    """A reply broke a bound or its encoding. Its text names what the server sent ("a
    truncated gzip body"), for a caller to put in its own sentence ("... sent {fault}")."""


class ReplyTooLarge(ReplyFault):
    """More than the limit: `announced` is the Content-Length that said so before the body
    was read, None when the body itself passed the limit (on the wire or inflated)."""

    def __init__(self, limit: int, announced: int | None = None) -> None:
        what = f"a reply of {announced} bytes" if announced is not None else "a reply"
        super().__init__(f"{what} larger than the limit of {limit} bytes")
        self.limit = limit
        self.announced = announced


class UnsupportedEncoding(ReplyFault):
    """A Content-Encoding other than gzip, deflate or identity (as sent: clip it to quote it)."""

    def __init__(self, encoding: str) -> None:
        super().__init__(f"a reply in an unsupported encoding {encoding[:40]!r}")
        self.encoding = encoding


class CorruptBody(ReplyFault):
    """The compressed body is not valid data in its encoding; `reason` is zlib's."""

    def __init__(self, encoding: str, reason: str) -> None:
        super().__init__(f"a corrupt {encoding} body: {reason}")
        self.encoding = encoding
        self.reason = reason


class ShortBody(ReplyFault):
    """The connection ended before the Content-Length was read: `received` bytes came,
    `missing` more were announced."""

    def __init__(self, received: int, missing: int) -> None:
        super().__init__(f"a body cut short ({received} bytes read, {missing} more announced)")
        self.received = received
        self.missing = missing


class TruncatedBody(ReplyFault):
    """The body ended inside its compressed stream."""

    def __init__(self, encoding: str) -> None:
        super().__init__(f"a truncated {encoding} body")
        self.encoding = encoding


def reply_inflater(encoding: str) -> Any:
    """A decompressor for a reply's Content-Encoding (lower case), None for none; ValueError
    for an encoding no reply here may use (the request asks for gzip or deflate only)."""
    if encoding in ("gzip", "x-gzip"):
        return zlib.decompressobj(16 + zlib.MAX_WBITS)
    if encoding == "deflate":
        return zlib.decompressobj()
    if encoding in ("identity", ""):
        return None
    raise ValueError(encoding)


def bounded_body(resp: http.client.HTTPResponse, limit: int) -> Iterator[bytes]:
    """The body of `resp` as it arrives, decompressed, at most `limit` bytes on the wire and
    after decompression; a ReplyFault (see the module) when it is not. The pieces are those
    the connection hands over (`read1`), so a stream is read as it comes."""
    length = (resp.getheader("Content-Length") or "").strip()
    if length.isdigit() and int(length) > limit:
        raise ReplyTooLarge(limit, int(length))
    encoding = (resp.getheader("Content-Encoding") or "identity").strip().lower()
    try:
        inflater = reply_inflater(encoding)
    except ValueError:
        raise UnsupportedEncoding(encoding) from None
    wire = out = 0
    while piece := resp.read1(READ_CHUNK):
        wire += len(piece)
        if wire > limit:
            raise ReplyTooLarge(limit)
        if inflater is not None:
            try:
                # never more than one byte past the bound: a bomb stops here
                piece = inflater.decompress(piece, limit + 1 - out)
            except zlib.error as e:
                raise CorruptBody(encoding, str(e)) from e
            if inflater.unconsumed_tail:  # the output filled what the bound allows
                raise ReplyTooLarge(limit)
        out += len(piece)
        if out > limit:
            raise ReplyTooLarge(limit)
        if piece:
            yield piece
    if resp.length:  # the connection closed before the declared Content-Length
        raise ShortBody(wire, resp.length)
    if inflater is not None:
        try:
            rest = inflater.flush()
        except zlib.error as e:
            raise CorruptBody(encoding, str(e)) from e
        if out + len(rest) > limit:
            raise ReplyTooLarge(limit)
        if not inflater.eof:
            raise TruncatedBody(encoding)
        if rest:
            yield rest
