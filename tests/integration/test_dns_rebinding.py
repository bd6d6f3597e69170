"""DNS rebinding: a page on evil.example whose name then resolves to 127.0.0.1 is, to the
browser, same-origin with its own name, so it can read the gateway's answers and send any
header. Without users every loopback request is anonymous with every right; the attacker
gets it unless the gateway refuses a Host it is not served under."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator

import aiohttp
import pytest

from gateway.client import Client
from gateway.config import Permission
from gateway.server import Gateway
from tests.integration.conftest import native_url, start_gateway
from tests.support.security import hashed_users


@pytest.fixture
async def anonymous(sqlite_url: str) -> AsyncIterator[Gateway]:
    """No users (anonymous from loopback, every right), and a queue with a message."""
    gateway = await start_gateway(sqlite_url, http_allowed_hosts=["keygate.internal"])
    try:
        async with Client(native_url(gateway)) as client:
            await client.declare_queue("victim", partitions=1)
            assert await client.publish("victim", b"private data")
        yield gateway
    finally:
        await gateway.stop()


def _as(gateway: Gateway, host: str) -> tuple[str, dict[str, str]]:
    """The admin URL and the headers a browser sends on a page at ``http://host:port``."""
    port = gateway.ports["http"]
    return f"http://127.0.0.1:{port}", {"Host": f"{host}:{port}", "Origin": f"http://{host}:{port}"}


async def test_a_rebound_name_reads_and_changes_nothing_on_an_anonymous_gateway(
    anonymous: Gateway,
) -> None:
    base, evil = _as(anonymous, "evil.example")
    async with aiohttp.ClientSession() as http:
        for method, path in [
            ("GET", "/api/queues/victim/messages"),
            ("GET", "/api/queues"),
            ("GET", "/api/status"),
            ("GET", "/"),
            ("DELETE", "/api/queues/victim"),
            ("POST", "/api/queues/victim/purge"),
        ]:
            async with http.request(method, base + path, headers=evil) as refused:
                assert refused.status == 403, (method, path)
                answer = await refused.json()
                assert answer["error"] == "permission-denied"
                assert "http_allowed_hosts" in answer["message"]
        # Basic credentials the page made up change nothing: without users none is checked.
        made_up = {**evil, "Authorization": "Basic " + base64.b64encode(b"admin:x").decode()}
        async with http.delete(base + "/api/queues/victim", headers=made_up) as refused:
            assert refused.status == 403
        async with http.get(base + "/api/queues/victim") as kept:
            assert (await kept.json())["depth"] == 1
        async with http.get(base + "/healthz", headers=evil) as probe:
            assert probe.status == 200  # probes may use any name


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "127.0.0.2", "[::1]", "10.1.2.3"])
async def test_loopback_names_and_ip_addresses_are_served(anonymous: Gateway, host: str) -> None:
    """An address in Host cannot have been rebound: the page's origin is the address."""
    base, headers = _as(anonymous, host)
    url = base + "/api/queues/victim/messages"
    async with aiohttp.ClientSession() as http, http.get(url, headers=headers) as read:
        assert read.status == 200
        assert (await read.json())[0]["payload"] == "private data"


async def test_a_name_in_http_allowed_hosts_is_served(anonymous: Gateway) -> None:
    base, headers = _as(anonymous, "KeyGate.Internal")
    url = base + "/api/queues/victim/purge"
    async with aiohttp.ClientSession() as http, http.post(url, headers=headers, json={}) as purged:
        assert purged.status == 200


async def test_with_users_an_authenticated_request_may_use_any_name(sqlite_url: str) -> None:
    """Behind a reverse proxy, or a gateway on 0.0.0.0 reached by any of its names: the
    credentials protect it (a rebinding page has none; the browser keeps the console's for
    the console's own origin)."""
    gateway = await start_gateway(
        sqlite_url,
        users=hashed_users(alice="alice-pw"),
        permissions={"alice": Permission(monitor=("*",))},
    )
    base, headers = _as(gateway, "keygate.example.com")
    alice = {**headers, "Authorization": "Basic " + base64.b64encode(b"alice:alice-pw").decode()}
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(base + "/api/queues", headers=alice) as listed:
                assert listed.status == 200
            async with http.get(base + "/api/queues", headers=headers) as anonymous:
                assert anonymous.status == 401
    finally:
        await gateway.stop()
