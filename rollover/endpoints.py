"""Where an engine is: the endpoint URL the gateway registers, calls and checks.

An engine on the gateway's machine listens on a Unix socket in a private folder; its endpoint
is `http+unix://`, the socket's absolute path percent-encoded (every `/` as `%2F`), then the
HTTP path: `http+unix://%2Ftmp%2Frollover-engine-1a2b%2Fengine.sock/v1` (the form of docker's
and requests-unixsocket's clients). An engine on another machine is `http(s)://host:port/path`.
"""

from __future__ import annotations

import functools
import ssl
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

UNIX_SCHEME = "http+unix"
# sun_path holds 108 bytes, the last a NUL.
MAX_SOCKET_PATH_BYTES = 107


@functools.cache
def client_tls() -> ssl.SSLContext:
    """httpx's default TLS context (the same roots and checks), built once per process and
    shared by Rollover's HTTP clients (`verify=client_tls()`). httpx builds one for every client
    it makes, reading the whole CA bundle each time: 50 ms on a quiet CPU, over 100 ms on a
    loaded one, paid by every management call to an engine even though those speak plain HTTP
    (its Unix socket or http://host:port)."""
    import httpx

    return httpx.create_ssl_context()


@dataclass(frozen=True)
class Endpoint:
    """An endpoint URL taken apart: `socket` for a Unix socket, else `host` and `port`."""

    scheme: str  # http, https or http+unix
    host: str  # the TCP host ("" for a socket)
    port: int  # the TCP port (0 for a socket)
    socket: str  # the socket's path ("" for TCP)
    path: str  # the HTTP path, with the query if any
    authority: str  # what the Host header says


def unix_endpoint(socket_path: str | Path, path: str = "") -> str:
    """The endpoint URL of `path` (e.g. "/v1") on the server listening on `socket_path`."""
    return f"{UNIX_SCHEME}://{quote(str(socket_path), safe='')}{path}"


def parse_endpoint(url: str) -> Endpoint:
    """`url` taken apart; a `ValueError` says what is wrong with it (not http(s) or http+unix,
    no host, a port outside 1..65535, a socket path that is not absolute or too long)."""
    parts = urlsplit(url)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    if parts.scheme == UNIX_SCHEME:
        socket = unquote(parts.netloc)
        if not socket.startswith("/") or "\x00" in socket:
            raise ValueError(f"must name an absolute socket path after {UNIX_SCHEME}://, got {url!r:.200}")
        if len(socket.encode()) > MAX_SOCKET_PATH_BYTES:
            raise ValueError(f"names a socket path longer than {MAX_SOCKET_PATH_BYTES} bytes: {url!r:.200}")
        return Endpoint(parts.scheme, "", 0, socket, path, "localhost")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(
            f"must be an http(s)://host:port[/path] or {UNIX_SCHEME}://SOCKET[/path] URL, got {url!r:.200}"
        )
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"has a port outside 1..65535: {url!r:.200}") from None
    if port == 0:
        raise ValueError(f"has a port outside 1..65535: {url!r:.200}")
    port = port or (443 if parts.scheme == "https" else 80)
    return Endpoint(parts.scheme, parts.hostname, port, "", path, parts.netloc.rpartition("@")[2])
