"""What a standby gateway's admin port answers, and what probes make of it: a standby is a
healthy gateway waiting for the lease."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp

from tests.integration.conftest import start_gateway
from tests.support.security import ADMIN, hashed_users
from tests.support.serve import unused_port
from tests.support.wait import eventually


@asynccontextmanager
async def _standby(db_url: str, **settings: Any) -> AsyncIterator[int]:
    """An active gateway and a standby beside it, on ``db_url``; the standby's admin port."""
    active = await start_gateway(db_url, lease_ttl=1.0, **settings)
    port = unused_port()
    standby = asyncio.create_task(
        start_gateway(db_url, lease_ttl=1.0, **{**settings, "http_port": port})
    )

    async def answers_standby() -> bool:
        try:
            url = f"http://127.0.0.1:{port}/healthz"
            async with aiohttp.ClientSession() as http, http.get(url) as response:
                return response.status == 503 and (await response.json())["role"] == "standby"
        except aiohttp.ClientError:
            return False

    try:
        await eventually(answers_standby, timeout=10)
        yield port
    finally:
        await active.stop()
        await (await asyncio.wait_for(standby, 15)).stop()


def _healthcheck(port: int, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", "healthcheck", *flags],
        env={**os.environ, "KEYGATE_HTTP_PORT": str(port)},
        capture_output=True,
        text=True,
        timeout=60,
    )


async def test_the_container_healthcheck_passes_on_a_standby_unless_the_active_role_is_asked(
    sqlite_url: str,
) -> None:
    """It exited 1 on a standby (whose /healthz answers 503), so the image's healthcheck
    marked every standby unhealthy and an orchestrator would restart it (QA)."""
    async with _standby(sqlite_url) as port:
        healthy = await asyncio.to_thread(_healthcheck, port)
        assert healthy.returncode == 0, healthy.stderr
        active = await asyncio.to_thread(_healthcheck, port, "--active")
        assert active.returncode == 1
        assert "standby" in active.stderr


async def test_a_standby_answers_status_only_to_users_and_every_error_as_json(
    sqlite_url: str,
) -> None:
    """Its /api/status answered without credentials where users are configured, and its
    other paths answered text/plain "404: Not Found" (QA)."""
    users = {"users": hashed_users(alice="alice-pw"), "permissions": {"alice": ADMIN}}
    async with _standby(sqlite_url, **users) as port, aiohttp.ClientSession() as http:
        base = f"http://127.0.0.1:{port}"
        alice = {"Authorization": aiohttp.encode_basic_auth("alice", "alice-pw")}
        async with http.get(base + "/api/status") as anonymous:
            assert anonymous.status == 401
            assert (await anonymous.json())["error"] == "authentication-failed"
        async with http.get(
            base + "/api/status", headers={"Authorization": aiohttp.encode_basic_auth("alice", "x")}
        ) as bad:
            assert bad.status == 401
        async with http.get(base + "/api/status", headers=alice) as status:
            assert status.status == 200
            assert (await status.json())["role"] == "standby"
        for method, path, code in [
            ("GET", "/api/queues", "not-found"),
            ("GET", "/no/such/path", "not-found"),
            ("POST", "/api/status", "method-not-allowed"),
        ]:
            async with http.request(method, base + path, headers=alice) as refused:
                assert refused.content_type == "application/json", (method, path)
                assert (await refused.json())["error"] == code, (method, path)
        async with http.get(base + "/healthz") as probe:
            assert probe.status == 503  # open to probes, as on the active gateway


async def test_a_standby_without_users_refuses_a_rebound_host(sqlite_url: str) -> None:
    async with _standby(sqlite_url) as port, aiohttp.ClientSession() as http:
        url = f"http://127.0.0.1:{port}/api/status"
        async with http.get(url) as status:
            assert (await status.json())["role"] == "standby"
        async with http.get(url, headers={"Host": f"evil.example:{port}"}) as refused:
            assert refused.status == 403
            assert (await refused.json())["error"] == "permission-denied"
