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
