"""A raw native-protocol client socket for tests that must misbehave (stall, stay silent)
where the SDK would not."""

from __future__ import annotations

import socket

from protocols.native.connection import ClientConnection
from protocols.native.events import Event


def expect(sock: socket.socket, conn: ClientConnection, kind: type[Event]) -> Event:
    """Read until the next event arrives; it must be a ``kind``."""
    while (event := conn.next_event()) is None:
        data = sock.recv(65536)
        assert data, "gateway closed the connection"
        conn.receive_data(data)
    assert isinstance(event, kind), event
    return event
