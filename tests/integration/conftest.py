"""A real gateway, in this process, on ephemeral loopback ports, for integration tests."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from gateway.config import LISTENERS, load_config
from gateway.server import Gateway


async def start_gateway(db_url: str, **overrides: Any) -> Gateway:
    """Start a gateway on ``db_url`` with every listener on a free loopback port."""
    settings: dict[str, Any] = {f"{name}_port": 0 for name in LISTENERS}
    settings.update(db=db_url, host="127.0.0.1", ack_flush_interval=0.02)
    settings.update(overrides)
    gateway = Gateway(load_config(env={}, overrides=settings))
    await gateway.start()
    return gateway


def native_url(gateway: Gateway) -> str:
    return f"keygate://127.0.0.1:{gateway.ports['native']}"


@pytest.fixture
async def gateway(db_url: str) -> AsyncIterator[Gateway]:
    """A running gateway on SQLite and, in a second run, on PostgreSQL."""
    gw = await start_gateway(db_url)
    try:
        yield gw
    finally:
        await gw.stop()


@pytest.fixture
async def sqlite_gateway(sqlite_url: str) -> AsyncIterator[Gateway]:
    """A running gateway on SQLite only, for tests of what does not depend on the database
    (the admin API's document, the console)."""
    gw = await start_gateway(sqlite_url)
    try:
        yield gw
    finally:
        await gw.stop()
