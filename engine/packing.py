"""Packed rows (event schema v6, docs/decisions.md entry 43): deflate against what came just
before.

A v5 stored payload (positional, with references) is small but still holds the words an
event writes: a response, a message, a tool's output. Events of one run repeat each other's
words far more than one event repeats its own, so a v6 row's payload is its v5 stored form
deflated with a preset dictionary, the *window*: the v5 stored bytes of the run's own earlier
events in the same block of `BLOCK` seqs (their last `WINDOW` bytes). A block's first event
has an empty window, so reading any event needs at most `BLOCK - 1` earlier rows of its run,
never the whole prefix: a branch is set up from its snapshot as before.

A packed payload starts with `PACKED`, a byte that starts no msgpack value, so a v6 row that
packing would not make smaller is stored as its v5 form unchanged. The hash chain covers the
canonical bytes, as for every version: a changed byte of a packed row changes the bytes it and
the rows packed against it unpack to, and `car verify` names those events.

Long texts (system prompts, in `texts`) are packed too: a text deflated alone, or against one
earlier text of the same journal named by its digest (the writer's first, itself unbased, so
a text needs at most one other to unpack). Their key stays the digest of the plain text.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Callable, Sequence

PACKED = b"\xc1"  # never the first byte of a msgpack value, nor of a UTF-8 text
BLOCK = 64  # seqs per block: a window never reaches back past a multiple of BLOCK
WINDOW = 8192  # bytes of the block's earlier events that an event is deflated against
MAX_PLAIN = 64 << 20  # larger payloads are stored as they are, so unpacking never exceeds it
LEVEL = 6
_TEXT_ALONE = 0
_TEXT_BASED = 1
DIGEST = 32


def is_packed(stored: bytes) -> bool:
    return stored[:1] == PACKED


def _deflate(data: bytes, zdict: bytes) -> bytes:
    # a 16 KiB window and small hash tables (memLevel 4): a compressor is made per row, and
    # zlib's default tables are ~270 KB to allocate for it (55 us a row in a fresh process,
    # the same as these in bench_compact's, whose allocator reuses them); the output is the
    # same size on the heists measured, and any raw deflate inflates with a 32 KiB window
    if zdict:
        c = zlib.compressobj(LEVEL, zlib.DEFLATED, -14, 4, zlib.Z_DEFAULT_STRATEGY, zdict)
    else:
        c = zlib.compressobj(LEVEL, zlib.DEFLATED, -14, 4)
    return c.compress(data) + c.flush()


def _inflate(data: bytes | memoryview, zdict: bytes) -> bytes:
    d = zlib.decompressobj(-15, zdict) if zdict else zlib.decompressobj(-15)
    try:
        # one byte past the bound: a stream of exactly MAX_PLAIN bytes must reach its end
        out = d.decompress(data, MAX_PLAIN + 1)
    except zlib.error as e:
        raise ValueError(f"packed bytes do not inflate ({e})") from e
    if len(out) > MAX_PLAIN or d.unconsumed_tail:
        raise ValueError(f"packed bytes inflate to more than {MAX_PLAIN} bytes")
    if not d.eof or d.unused_data:
        raise ValueError("packed bytes are cut short or carry bytes past their end")
    return out


def pack(plain: bytes, window: bytes) -> bytes:
    """The v6 stored form of v5 stored bytes `plain` after `window`."""
    if len(plain) > MAX_PLAIN:
        return plain
    packed = PACKED + _deflate(plain, window)
    # bytes that would read as packed are packed whatever it costs (no v5 payload starts so)
    return packed if len(packed) < len(plain) or is_packed(plain) else plain


def unpack(stored: bytes, window: bytes) -> bytes:
    """The v5 stored bytes of a v6 stored payload; ValueError if they cannot be had."""
    if not is_packed(stored):
        return stored
    return _inflate(memoryview(stored)[1:], window)


def pack_text(body: bytes, base: tuple[bytes, bytes] | None) -> bytes:
    """A text's stored form: deflated alone, or against `base` (its digest and plain text)."""
    if base is None:
        packed = PACKED + bytes([_TEXT_ALONE]) + _deflate(body, b"")
    else:
        digest, plain = base
        packed = PACKED + bytes([_TEXT_BASED]) + digest + _deflate(body, plain[-32768:])
    return packed if len(packed) < len(body) else body


def text_base(stored: bytes) -> bytes | None:
    """The digest of the text a stored text is packed against (None: alone or plain)."""
    if is_packed(stored) and stored[1:2] == bytes([_TEXT_BASED]):
        if len(stored) < 2 + DIGEST:
            raise ValueError("packed text is cut short")
        return stored[2 : 2 + DIGEST]
    return None


def unpack_text(stored: bytes, base_plain: bytes | None) -> bytes:
    """A stored text's plain bytes (`base_plain`: those of its `text_base`)."""
    if not is_packed(stored):
        return stored
    flag = stored[1:2]
    if flag == bytes([_TEXT_ALONE]):
        return _inflate(memoryview(stored)[2:], b"")
    if flag == bytes([_TEXT_BASED]) and base_plain is not None and len(stored) >= 2 + DIGEST:
        return _inflate(memoryview(stored)[2 + DIGEST :], base_plain[-32768:])
    raise ValueError("packed text has an unknown form")


MAX_TEXT_DEPTH = 4  # texts a text may be packed against in a row (a writer makes at most 1)


def plain_text(stored: bytes, base_of: Callable[[bytes, int], bytes], depth: int = 0) -> bytes:
    """A stored text's plain bytes; `base_of(digest, depth + 1)` gives its base's (the same
    function, one text further along the chain). ValueError for a chain that is too long."""
    base = text_base(stored)
    if base is None:
        return unpack_text(stored, None)
    if depth >= MAX_TEXT_DEPTH:
        raise ValueError("it is packed against a chain of texts, or a cycle")
    return unpack_text(stored, base_of(base, depth + 1))


class _Block:
    """The plain (v5) bytes of one run's own events in one block, every seq below `upto`."""

    __slots__ = ("plain", "tail", "upto")

    def __init__(self, start: int) -> None:
        self.plain: dict[int, bytes] = {}
        self.tail = b""  # the last WINDOW bytes of the plain bytes so far, in seq order
        self.upto = start

    def add(self, seq: int, plain: bytes) -> None:
        self.plain[seq] = plain
        self.tail = (self.tail + plain)[-WINDOW:]
        self.upto = seq + 1


Fetch = Callable[[str, int, int], Sequence[tuple[int, int, bytes]]]


class Unpacker:
    """The v5 stored bytes of rows as stored, with the windows they need.

    `fetch(run, lo, hi)` returns (seq, version, stored payload) of the run's own rows with
    lo <= seq < hi in seq order. Blocks read or written are kept, so a run read in seq order
    fetches nothing more; memory is bounded (forgetting costs reads only)."""

    def __init__(
        self, fetch: Fetch, max_blocks: int = 2048, lock: threading.RLock | None = None
    ) -> None:
        self._fetch = fetch
        self._blocks: dict[tuple[str, int], _Block] = {}
        self._max = max_blocks
        # one journal serves several threads: a block is extended by one at a time. `fetch`
        # takes the journal's lock, so the journal passes that lock here: with a lock of
        # its own, a reader holding it would wait for the journal's while a writer holding
        # the journal's waited for it
        self._lock = lock if lock is not None else threading.RLock()

    def clear(self) -> None:
        with self._lock:
            self._blocks.clear()

    def plain(self, run: str, seq: int, version: int, stored: bytes) -> bytes:
        """The v5 stored bytes of the run's own row `seq` (`version`, `stored` as read)."""
        if version < 6:
            return stored
        start = seq - seq % BLOCK
        with self._lock:
            block = self._blocks.get((run, start))
            if block is not None and seq < block.upto:
                got = block.plain.get(seq)
                if got is not None:
                    return got
            block = self._extended(run, start, seq)
            out = unpack(stored, block.tail)
            block.add(seq, out)
            return out

    def window(self, run: str, seq: int) -> bytes:
        """What the run's next row `seq` is packed against (its rows below `seq` written)."""
        start = seq - seq % BLOCK
        with self._lock:
            return self._extended(run, start, seq).tail

    def pack_rows(self, run: str, seq: int, plains: Sequence[bytes]) -> list[bytes]:
        """The stored form of the run's next rows from `seq` on (v5 stored bytes `plains`)."""
        tail = self.window(run, seq)
        out = []
        for i, p in enumerate(plains):
            if (seq + i) % BLOCK == 0:
                tail = b""
            out.append(pack(p, tail))
            tail = (tail + p)[-WINDOW:]
        return out

    def remember(self, run: str, seq: int, plain: bytes) -> None:
        """A row this writer has committed, so that the next one's window is at hand (its
        block is the one `pack_rows` read; a row that does not follow on is not taken)."""
        with self._lock:
            block = self._blocks.get((run, seq - seq % BLOCK))
            if block is not None and block.upto == seq:
                block.add(seq, plain)

    def _extended(self, run: str, start: int, seq: int) -> _Block:
        """The block of `seq`, holding every row of the run below `seq` (read if need be)."""
        block = self._blocks.get((run, start))
        if block is None or block.upto > seq:
            block = _Block(start)
        if block.upto < seq:
            for s, version, stored in self._fetch(run, block.upto, seq):
                block.add(s, unpack(stored, block.tail) if version >= 6 else stored)
            block.upto = seq
        if len(self._blocks) >= self._max and (run, start) not in self._blocks:
            self._blocks.clear()
        self._blocks[(run, start)] = block
        return block
