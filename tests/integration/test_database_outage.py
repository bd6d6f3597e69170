"""PostgreSQL drops the gateway's connections (restart, failover, an idle-connection
killer): the gateway replaces them and keeps serving without failing a publish.

PostgreSQL refuses every session for a while (a restart, ``ALTER DATABASE ...
ALLOW_CONNECTIONS false``), played by a proxy between the gateway and the server
(tests.support.postgres), never by the shared server itself: publishes meanwhile are told
``storage-unavailable``, the log says so once rather than once per publish, and the
gateway renews its lease again once the database answers within ``lease_ttl``. Retention
runs meanwhile fail without a line each, and delete what expired once it answers again.

A link to the database that goes silent (a black hole: nothing refused, nothing answered)
while ``keygate serve`` is told to stop (SIGTERM): the drain gives up on the publishes in
flight, the final writes get lease_ttl, and the process exits — it used to wait forever.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from core.errors import StorageError, StorageUnavailable
from gateway.client import Client, ConnectionLost
from gateway.server import Gateway
from protocols.native.listener import CLOSE_WAIT, DRAIN_TIMEOUT
from storage.engine import GATEWAY_APPLICATION, sync_engine
from storage.outage import OUTAGE_SUMMARY_INTERVAL
from tests.integration.conftest import native_url, start_gateway
from tests.support.postgres import not_accepting_connections, server_port, through
from tests.support.proxy import TcpProxy
from tests.support.serve import serve
from tests.support.wait import eventually

pytestmark = pytest.mark.postgres

# Publishes tried while the database refuses sessions.
PUBLISHES = 40
# Retention runs that fail while the database refuses sessions.
FAILED_RUNS = 6
_LEASE_LEFT = sa.text(
    "SELECT expires_at - extract(epoch FROM clock_timestamp()) FROM kg_gateway_lease"
)


def _terminate_gateway_sessions(url: str) -> int:
    """End every gateway session (not the test's own, nor other tools' sessions)."""
    libpq = make_url(url).set(drivername="postgresql").difference_update_query(["search_path"])
    with psycopg.connect(libpq.render_as_string(hide_password=False), autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND application_name = %s",
            (GATEWAY_APPLICATION,),
        ).fetchone()
    return int(row[0]) if row else 0


async def test_dropped_database_connections_are_replaced_without_failing_publishes(
    postgres_url: str,
) -> None:
    gateway = await start_gateway(postgres_url)
    try:
        async with Client(native_url(gateway)) as client:
            await client.declare_queue("orders", partitions=2)
            consumer = await client.subscribe("orders", group="g")
            for i in range(5):
                await client.publish("orders", b"%d" % i, key="k")
            assert await asyncio.to_thread(_terminate_gateway_sessions, postgres_url) > 0
            for i in range(5, 15):
                await client.publish("orders", b"%d" % i, key="k")
            got = [int((await consumer.receive(timeout=10)).payload) for _ in range(15)]
            assert got == list(range(15))
    finally:
        await gateway.stop()


def _lease_left(url: str) -> float:
    """Seconds until the gateway lease expires, by the database's clock."""
    engine = sync_engine(url)
    try:
        with engine.connect() as conn:
            left = conn.execute(_LEASE_LEFT).scalar_one()
    finally:
        engine.dispose()
    return float(left)


def _rejected(gateway: Gateway, reason: str) -> float:
    assert gateway.broker is not None
    value = gateway.broker.metrics.registry.get_sample_value(
        "keygate_publish_rejected_total", {"reason": reason}
    )
    return value or 0.0


def _told_once(records: list[logging.LogRecord], seconds: float) -> None:
    """An outage of ``seconds`` is told by one WARNING when it begins and at most one
    summary per OUTAGE_SUMMARY_INTERVAL: every WARNING of it, whatever its text, counts
    (a line per refused call, worded any way, fails here)."""
    warned = [r.getMessage() for r in records if r.levelno >= logging.WARNING]
    assert warned and warned[0].startswith("database unavailable: "), warned
    assert all(m.startswith("database unavailable") for m in warned), warned
    assert len(warned) <= 1 + int(seconds // OUTAGE_SUMMARY_INTERVAL), warned


async def test_publishes_while_the_database_refuses_sessions_are_storage_unavailable_logged_once(
    postgres_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    async with TcpProxy(server_port(postgres_url)) as proxy:
        gateway = await start_gateway(through(postgres_url, proxy.port), lease_ttl=60.0)
        try:
            async with Client(native_url(gateway)) as client:
                await client.declare_queue("orders", partitions=2)
                await client.publish("orders", b"before", key="k")
                caplog.clear()
                proxy.cut(answer=not_accepting_connections)
                cut = time.monotonic()
                refused: list[StorageError] = []
                for i in range(PUBLISHES):
                    with pytest.raises(StorageError) as caught:
                        await client.publish("orders", b"%d" % i, key=f"k{i}")
                    refused.append(caught.value)
                during, lasted = list(caplog.records), time.monotonic() - cut
                proxy.restore()
                await eventually(lambda: _published(client), timeout=10)
            assert {type(e) for e in refused} == {StorageUnavailable}
            assert _rejected(gateway, "storage-unavailable") == PUBLISHES
            assert _rejected(gateway, "storage-error") == 0
            # Said once (a summary at most every few seconds), no traceback per publish.
            assert [r for r in during if r.exc_info] == []
            assert [r for r in during if r.levelno >= logging.ERROR] == []
            _told_once(during, lasted)  # not a line per refused publish (PUBLISHES of them)
            assert "database answers again" in caplog.text
        finally:
            await gateway.stop()


async def _published(client: Client) -> bool:
    try:
        await client.publish("orders", b"after", key="k")
    except StorageUnavailable:
        return False
    return True


async def test_an_active_gateway_renews_its_lease_again_once_the_database_answers(
    postgres_url: str,
) -> None:
    """An outage shorter than lease_ttl: a renewal fails meanwhile, the next one works.
    (The renewal task used to die of asyncpg's own error, so the gateway stayed "active"
    with its lease lapsed, beside the standby that took it over.)"""
    ttl = 3.0
    async with TcpProxy(server_port(postgres_url)) as proxy:
        # No housekeeping writes, which would renew the lease too: the renewals alone.
        url = through(postgres_url, proxy.port)
        gateway = await start_gateway(url, lease_ttl=ttl, retention_interval=3600.0)
        try:
            # Start the outage just after a renewal, so that it ends well within lease_ttl.
            before = await asyncio.to_thread(_lease_left, postgres_url)
            await eventually(
                lambda: asyncio.to_thread(lambda: _lease_left(postgres_url) > before), timeout=ttl
            )
            proxy.cut(answer=not_accepting_connections)
            cut = time.monotonic()
            await eventually(lambda: proxy.refused > 0, timeout=ttl)  # a renewal was refused
            await asyncio.sleep(max(0.0, cut + ttl / 2 - time.monotonic()))  # the outage
            proxy.restore()

            # Renewed again: the lease outlives the last renewal before the outage.
            async def renewed() -> bool:
                past = time.monotonic() > cut + ttl
                return past and await asyncio.to_thread(_lease_left, postgres_url) > 0

            await eventually(renewed, timeout=3 * ttl, interval=0.2)
            assert not gateway.lost_lease
            assert gateway.broker is not None
            active = gateway.broker.metrics.registry.get_sample_value("keygate_gateway_active")
            assert active == 1
        finally:
            await gateway.stop()


def _stored(url: str) -> int:
    engine = sync_engine(url)
    try:
        with engine.connect() as conn:
            return int(conn.execute(sa.text("SELECT count(*) FROM kg_messages")).scalar_one())
    finally:
        engine.dispose()


async def test_retention_runs_through_an_outage_told_once_and_deletes_once_it_answers(
    postgres_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    async with TcpProxy(server_port(postgres_url)) as proxy:
        url = through(postgres_url, proxy.port)
        gateway = await start_gateway(url, lease_ttl=60.0, retention_interval=0.1)
        try:
            assert gateway.store is not None
            retention = gateway.store.retention
            failed: list[StorageError] = []

            async def counted(**kwargs: Any) -> int:
                try:
                    return await retention(**kwargs)
                except StorageError as e:
                    failed.append(e)
                    raise

            gateway.store.retention = counted  # type: ignore[method-assign]
            async with Client(native_url(gateway)) as client:
                await client.declare_queue("expiring", partitions=2)  # no group: expiry only
                for i in range(20):
                    await client.publish("expiring", b"%d" % i, key=f"k{i}", ttl=1.0)
                caplog.clear()
                proxy.cut(answer=not_accepting_connections)
                cut = time.monotonic()
                expired_at = cut + 1.0
                assert await asyncio.to_thread(_stored, postgres_url) == 20
                await eventually(
                    lambda: len(failed) >= FAILED_RUNS and time.monotonic() > expired_at,
                    timeout=10,
                )
                during, lasted = list(caplog.records), time.monotonic() - cut
                proxy.restore()

                async def deleted() -> bool:
                    return await asyncio.to_thread(_stored, postgres_url) == 0

                await eventually(deleted, timeout=10)
            assert {type(e) for e in failed} == {StorageUnavailable}
            _told_once(during, lasted)  # not once per retention run
            assert not gateway.failed
        finally:
            await gateway.stop()


def _payloads(url: str) -> set[bytes]:
    engine = sync_engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(sa.text("SELECT payload FROM kg_messages")).scalars()
            return {bytes(payload) for payload in rows}
    finally:
        engine.dispose()


async def test_a_stop_while_the_database_link_is_a_black_hole_exits_within_its_bounds(
    postgres_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGTERM with native publishes waiting for a database that answers nothing: the
    drain gives up on them after DRAIN_TIMEOUT (they are not confirmed), the final writes
    and the store's close after lease_ttl, and the process exits with a line saying so."""
    lease_ttl = 4.0
    # The drain, the connection's goodbye, the final writes, and a start-up's worth.
    bound = DRAIN_TIMEOUT + 2 * CLOSE_WAIT + lease_ttl + 5.0
    monkeypatch.setenv("KEYGATE_LEASE_TTL", str(lease_ttl))
    async with TcpProxy(server_port(postgres_url)) as proxy:
        with ExitStack() as stack:
            proc, ports, log = await asyncio.to_thread(
                stack.enter_context, serve(through(postgres_url, proxy.port), tmp_path)
            )
            async with Client(f"keygate://127.0.0.1:{ports['native']}") as client:
                await client.declare_queue("orders", partitions=2)
                confirmed = {b"confirmed %d" % i for i in range(5)}
                for payload in sorted(confirmed):
                    await client.publish("orders", payload, key="k")
                proxy.freeze()
                in_flight = [
                    asyncio.create_task(client.publish("orders", b"in flight %d" % i, key="k"))
                    for i in range(10)
                ]
                await eventually(lambda: proxy.held_back > 0, timeout=10)  # its append
                proc.send_signal(signal.SIGTERM)
                started = time.monotonic()
                try:
                    code = await asyncio.to_thread(proc.wait, bound + 30)
                finally:
                    if proc.poll() is None:
                        proc.kill()
                stopped_after = time.monotonic() - started
                outcomes = await asyncio.gather(*in_flight, return_exceptions=True)
        text = log.read_text()
        assert code == 0, text
        assert stopped_after < bound, text
        assert "were not confirmed" in text, text
        assert all(isinstance(outcome, ConnectionLost) for outcome in outcomes), outcomes
        assert confirmed <= await asyncio.to_thread(_payloads, postgres_url)
