"""Active/standby when the database itself misbehaves, with real ``keygate serve``
processes on one PostgreSQL schema (docs/operations.md, "High availability"):

- a standby whose takeover meets the old active's last write still holding the lease row
  (past the 1 s lock timeout) keeps polling and takes over, instead of exiting;
- an active gateway whose link to the database goes silent (a black hole, not a reset)
  stops within a few lease_ttl and exits non-zero, so that a supervisor can restart it as
  a standby — it used to hang until the link came back;
- an active gateway whose database refuses every session for longer than lease_ttl (a
  restart, ``ALLOW_CONNECTIONS false``) stops and exits non-zero before its lease lapses,
  and the standby, refused as well meanwhile, keeps trying and takes over afterwards —
  the active used to stay up answering "active" beside it, its renewals dead.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from contextlib import ExitStack
from pathlib import Path

import pytest

from gateway.cli import main
from storage.engine import sync_engine
from tests.support.postgres import not_accepting_connections, server_port, through
from tests.support.proxy import TcpProxy
from tests.support.serve import serve, unused_port
from tests.support.wait import eventually

pytestmark = pytest.mark.postgres

LEASE_TTL = 2.0


def _hold_the_lease_row(url: str, held: threading.Event, release: threading.Event) -> None:
    """What the old active's write does (kg_fence): hold the lease row FOR SHARE."""
    engine = sync_engine(url)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql("SELECT * FROM kg_gateway_lease FOR SHARE").all()
            held.set()
            release.wait(60)
    finally:
        engine.dispose()


async def test_a_standby_outlives_a_takeover_that_meets_the_lease_row_locked(
    postgres_url: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """... and ``keygate status`` says what it is meanwhile (it said HTTP 404)."""
    monkeypatch.setenv("KEYGATE_LEASE_TTL", str(LEASE_TTL))
    http_b = unused_port()
    held, release = threading.Event(), threading.Event()
    with ExitStack() as stack:
        proc_a, _, _ = stack.enter_context(serve(postgres_url, tmp_path, name="a"))
        holder = threading.Thread(target=_hold_the_lease_row, args=(postgres_url, held, release))
        holder.start()
        try:
            assert await asyncio.to_thread(held.wait, 30)
            os.kill(proc_a.pid, signal.SIGKILL)
            log_b = tmp_path / "b.log"
            standby = asyncio.create_task(
                asyncio.to_thread(
                    stack.enter_context,
                    serve(postgres_url, tmp_path, f"--http-port={http_b}", name="b"),
                )
            )
            # Its lease lapsed; the standby's takeover waits for the row and gives up.
            await eventually(
                lambda: log_b.exists() and "taking the gateway lease failed" in log_b.read_text(),
                timeout=30,
            )
            status = ["status", f"--url=http://127.0.0.1:{http_b}"]
            assert await asyncio.to_thread(main, status) == 0
            assert "gateway keygate: standby" in capsys.readouterr().out
        finally:
            release.set()
            await asyncio.to_thread(holder.join)
        proc_b, ports_b, _ = await asyncio.wait_for(standby, 60)  # it became active
        assert proc_b.poll() is None
        assert "took over as the active gateway" in log_b.read_text()
        assert ports_b["native"] > 0


async def test_an_active_gateway_whose_database_goes_silent_stops_and_exits(
    postgres_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KEYGATE_LEASE_TTL", str(LEASE_TTL))
    async with TcpProxy(server_port(postgres_url)) as proxy:
        with ExitStack() as stack:
            proc, _, log = await asyncio.to_thread(
                stack.enter_context, serve(through(postgres_url, proxy.port), tmp_path)
            )
            proxy.freeze()
            started = time.monotonic()
            code = await asyncio.to_thread(proc.wait, 10 * LEASE_TTL)
            stopped_after = time.monotonic() - started
            assert code != 0, log.read_text()
            assert "lost the gateway lease" in log.read_text()
            assert stopped_after < 5 * LEASE_TTL, log.read_text()


def _health(port: int) -> tuple[int, str] | None:
    """``/healthz`` of the gateway whose admin port is ``port``: (status, role), or None
    when nothing answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as answer:
            return answer.status, json.loads(answer.read())["role"]
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())["role"]
    except OSError:
        return None


async def test_a_database_refusing_sessions_past_lease_ttl_stops_the_active_and_not_the_standby(
    postgres_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KEYGATE_LEASE_TTL", str(LEASE_TTL))
    http_b = unused_port()

    async def health(port: int) -> tuple[int, str] | None:
        # Off the event loop: it runs the proxy the gateways talk to the database through.
        return await asyncio.to_thread(_health, port)

    async with TcpProxy(server_port(postgres_url)) as proxy:
        url = through(postgres_url, proxy.port)
        stack = ExitStack()
        try:
            proc_a, ports_a, log_a = await asyncio.to_thread(
                stack.enter_context, serve(url, tmp_path, name="a")
            )
            log_b = tmp_path / "b.log"
            standby = asyncio.create_task(
                asyncio.to_thread(
                    stack.enter_context, serve(url, tmp_path, f"--http-port={http_b}", name="b")
                )
            )
            await eventually(lambda: health(http_b), timeout=30)
            assert await health(http_b) == (503, "standby")
            # It has seen the active's lease (its admin port answers before that; a
            # database that fails its very first contact fails its start instead).
            await eventually(lambda: "is active elsewhere" in log_b.read_text(), timeout=30)
            proxy.cut(answer=not_accepting_connections)
            started = time.monotonic()
            # The active cannot renew: it stops within lease_ttl (and a little), exit 1.
            code = await asyncio.to_thread(proc_a.wait, 5 * LEASE_TTL)
            assert code == 1, log_a.read_text()
            assert time.monotonic() - started < 2 * LEASE_TTL, log_a.read_text()
            assert "lost the gateway lease" in log_a.read_text()
            assert await health(ports_a["http"]) is None
            # The standby is refused too: it keeps trying, still a standby, past the
            # moment the lease lapsed.
            await eventually(
                # (it waits in opening the store: it takes the lease with its migration)
                lambda: log_b.read_text().count("standby: opening the store failed") >= 2,
                timeout=10,
            )
            assert not standby.done(), log_b.read_text()
            assert await health(http_b) == (503, "standby")
            proxy.restore()
            proc_b, ports_b, _ = await asyncio.wait_for(standby, 60)  # it became active
            assert proc_b.poll() is None
            assert await health(ports_b["http"]) == (200, "active")
            assert "Traceback" not in log_b.read_text()
        finally:
            proxy.restore()
            await asyncio.to_thread(stack.close)
