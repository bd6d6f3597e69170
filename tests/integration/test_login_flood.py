"""Password guessing spread over many addresses. A client may bind any of 127.0.0.0/8
before it connects to a listener on 127.0.0.1 (QA's flood came from 127.0.0.2,
127.0.0.3, ...): each address stayed under its own budget of failed logins, every guess
cost a scrypt, and the hashes took the CPU the rest of the gateway needed. Now one user
name has a budget too, whatever the addresses, and the hashes computed at once are
bounded, so logins that need none go on as before."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import AsyncIterator

import pytest

from gateway.client import Client
from gateway.security import USER_LIMIT
from gateway.server import Gateway
from protocols.native.events import Error, Hello, HelloOk
from tests.integration.conftest import native_url, start_gateway
from tests.support import native_raw
from tests.support.security import hashed_users
from tests.support.wait import eventually


def _address(n: int) -> str:
    """The n-th of 64,000 loopback addresses, none of them 127.0.0.1."""
    return f"127.1.{n // 250}.{n % 250 + 1}"


async def _hello(port: int, source: str, username: str, password: str) -> str:
    """Log in from ``source`` with a native HELLO: "logged in", or the refusal's text."""
    client = await native_raw.connect(port, source=source)
    try:
        reply = await client.request(
            Hello(client_name="guesser", username=username, password=password)
        )
    finally:
        client.close()
    if isinstance(reply, HelloOk):
        return "logged in"
    assert isinstance(reply, Error), reply
    return reply.text


@pytest.fixture
async def gateway(sqlite_url: str) -> AsyncIterator[Gateway]:
    gw = await start_gateway(sqlite_url, users=hashed_users(alice="alice-pw", bob="bob-pw"))
    try:
        yield gw
    finally:
        await gw.stop()


async def test_guesses_for_one_user_from_many_addresses_are_blocked(gateway: Gateway) -> None:
    port = gateway.ports["native"]
    assert await _hello(port, "127.0.0.1", "alice", "alice-pw") == "logged in"
    answers = [await _hello(port, _address(i), "alice", f"guess-{i}") for i in range(30)]
    assert answers[:USER_LIMIT] == ["bad username or password"] * USER_LIMIT
    blocked = "too many failed logins for user 'alice'"
    assert all(answer.startswith(blocked) for answer in answers[USER_LIMIT:]), answers
    # While blocked, even the right password from an address alice never used is refused;
    # the address she logged in from, other users and other addresses are not affected.
    assert (await _hello(port, _address(99), "alice", "alice-pw")).startswith(blocked)
    assert await _hello(port, "127.0.0.1", "alice", "alice-pw") == "logged in"
    assert await _hello(port, _address(100), "bob", "bob-pw") == "logged in"


ATTACKERS = 8


async def _canary_logins(url: str, seconds: float) -> list[float]:
    """Log in and out with the SDK for ``seconds``: how long each round trip took."""
    loop = asyncio.get_running_loop()
    took = []
    end = loop.time() + seconds
    while loop.time() < end:
        started = loop.time()
        async with Client(url, username="bob", password="bob-pw", max_reconnect_attempts=0):
            pass
        took.append(loop.time() - started)
    return took


async def test_a_flood_of_guesses_over_many_names_and_addresses_leaves_logins_their_cpu(
    gateway: Gateway,
) -> None:
    """Every guess names another user (unknown names cost a full hash too) from another
    address, so neither budget ever blocks: only the bound on hashes at once holds the
    flood to its share of the CPU. The attackers share this test's event loop with the
    gateway, so one refused at once pauses a little before its next guess: this test is
    about the hashing, not about a flood of connections."""
    port, url = gateway.ports["native"], native_url(gateway)
    baseline = await _canary_logins(url, 1.5)
    answers: collections.Counter[str] = collections.Counter()
    stop = asyncio.Event()

    async def attacker(first: int) -> None:
        n = first
        while not stop.is_set():
            answer = await _hello(port, _address(n), f"nobody-{n}", "guess")
            answers[answer] += 1
            n += ATTACKERS
            if answer.startswith("too many logins being checked"):
                await asyncio.sleep(0.1)

    attackers = [asyncio.create_task(attacker(k)) for k in range(ATTACKERS)]
    try:
        await eventually(lambda: answers["bad username or password"] >= ATTACKERS)
        during = await _canary_logins(url, 3.0)
    finally:
        stop.set()
        await asyncio.gather(*attackers)
    assert answers["bad username or password"] >= 2 * ATTACKERS  # the flood was hashed
    assert set(answers) <= {
        "bad username or password",
        "too many logins being checked at once; retry shortly",
    }
    # On two cores: 0.3-0.5 of the rate without the flood (one core hashes); 0.08-0.14
    # when every guess had a thread to hash on.
    rate, flooded = len(baseline) / 1.5, len(during) / 3.0
    assert flooded >= rate / 5, (rate, flooded)
    assert max(during) < 1.0, max(during)
