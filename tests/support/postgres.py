"""Just enough of PostgreSQL's wire protocol to play a server that refuses every session,
as one does while it is starting up, shutting down, or after ``ALTER DATABASE ...
ALLOW_CONNECTIONS false``: use as ``TcpProxy.cut(answer=not_accepting_connections)``.

A client may first ask for TLS or GSS encryption (an 8-byte request, answered "N": not
supported here), then sends its startup message; the server answers with a FATAL
ErrorResponse and closes the connection. Drivers raise that as they do for a real server:
asyncpg as ObjectNotInPrerequisiteStateError, outside SQLAlchemy; psycopg as
OperationalError.
"""

from __future__ import annotations

import asyncio
import struct
from typing import Final
from urllib.parse import urlsplit, urlunsplit

# Request codes a client may send before its startup message (SSLRequest, GSSENCRequest).
_ENCRYPTION_REQUESTS: Final = frozenset({80877103, 80877104})
NOT_ACCEPTING: Final = ("55000", 'database "keygate" is not currently accepting connections')


def through(url: str, port: int) -> str:
    """``url`` with its host and port replaced by a proxy's on loopback."""
    parts = urlsplit(url)
    netloc = parts.netloc.rsplit("@", 1)
    host = f"127.0.0.1:{port}"
    return urlunsplit(parts._replace(netloc=f"{netloc[0]}@{host}" if len(netloc) == 2 else host))


def server_port(url: str) -> int:
    """The port of the PostgreSQL server ``url`` names."""
    return urlsplit(url).port or 5432


def error_response(sqlstate: str, message: str) -> bytes:
    """A FATAL ErrorResponse message."""
    fields = b"".join(
        code + value.encode() + b"\0"
        for code, value in ((b"S", "FATAL"), (b"V", "FATAL"), (b"C", sqlstate), (b"M", message))
    )
    body = fields + b"\0"
    return b"E" + struct.pack("!i", len(body) + 4) + body


async def not_accepting_connections(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    """Refuse the session as PostgreSQL does for a database not accepting connections."""
    while True:
        (length,) = struct.unpack("!i", await reader.readexactly(4))
        packet = await reader.readexactly(length - 4)
        (code,) = struct.unpack("!i", packet[:4])
        if code not in _ENCRYPTION_REQUESTS:
            break
        writer.write(b"N")
        await writer.drain()
    writer.write(error_response(*NOT_ACCEPTING))
    await writer.drain()


__all__ = [
    "NOT_ACCEPTING",
    "error_response",
    "not_accepting_connections",
    "server_port",
    "through",
]
