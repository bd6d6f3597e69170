"""The native server's answers as docs/native-protocol.md states them, over a real socket
and an in-memory sink: HELLO refusals (§3), settling a flow id the connection does not
know (§4), CREDIT's bounds (§5) and CLOSE after pipelined PUBLISHes (§2)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from core.model import QueueConfig
from protocols.native.events import (
    Close,
    Error,
    Event,
    Hello,
)
from protocols.native.listener import NativeListener
from protocols.sink import Principal
from tests.support.memory_sink import MemorySink
from tests.support.native_raw import RawClient, connect

ME = Principal(None, "test")


@asynccontextmanager
async def _serving(sink: MemorySink) -> AsyncIterator[int]:
    await sink.declare_queue(ME, QueueConfig("q"))
    listener = NativeListener(sink)  # type: ignore[arg-type]
    port = await listener.start("127.0.0.1", 0, None)
    try:
        yield port
    finally:
        await listener.close()


async def _rest(client: RawClient) -> list[Event]:
    """Every event until the gateway closes the connection."""
    events = []
    while (event := await client.receive()) is not None:
        events.append(event)
    return events


@pytest.mark.parametrize(
    ("hello", "code"),
    [
        (Hello(request_id=7, username="alice", password="wrong"), "authentication-failed"),
        (Hello(request_id=7, version=0, username="alice", password="pw"), "unsupported-version"),
        (Hello(request_id=7, client_name="n" * 501, username="alice", password="pw"),
         "invalid-argument"),
    ],
)  # fmt: skip
async def test_a_refused_hello_gets_an_error_with_its_id_then_close(
    hello: Hello, code: str
) -> None:
    async with _serving(MemorySink(users={"alice": "pw"})) as port:
        client = await connect(port)
        try:
            client.send(hello)
            error, close = await _rest(client)
        finally:
            client.close()
        assert isinstance(error, Error) and (error.request_id, error.code) == (7, code)
        assert isinstance(close, Close)
