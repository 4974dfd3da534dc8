"""The one check of an http(s) URL a user gives (a model server, an upstream, an OTLP endpoint):
refused in one line, never left to fail deep in a socket call with a traceback."""

from __future__ import annotations

import urllib.parse

#: What `http_url_problem` says of a URL that parses but is no http(s) URL with a host.
NOT_HTTP = "expected http://HOST[:PORT]/PATH or https://..."


def http_url_problem(url: str) -> str | None:
    """What is wrong with `url` as http(s)://HOST[:PORT]/PATH, None if nothing is: a bracket
    left open (`http://[::1`), a port out of range or not a number, another scheme, no host."""
    try:
        parts = urllib.parse.urlsplit(url)
        parts.port  # noqa: B018  # a bad port raises only when asked for
    except ValueError as e:
        return str(e)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return NOT_HTTP
    return None
