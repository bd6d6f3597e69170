"""Attack: another connection settles, throttles or unbinds a consumer's flow.

Flow ids are not secret (``GET /api/queues/{q}/inspect`` lists them to any authenticated
user), so the gateway refuses every ACK, NACK, CREDIT and UNBIND of a flow from any
connection but the one that bound it — the same user on a second connection included.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Callable
from typing import Any

import aiohttp
import pytest

from core.errors import PermissionDenied
from gateway.client import Client, Consumer, Message
from protocols.native.events import Ack, Credit, Event, Nack, NackOutcome, Unbind
from tests.integration.conftest import native_url, start_gateway
from tests.support.security import ADMIN, hashed_users
from tests.support.wait import eventually

USERS = {"alice": "secret", "mallory": "pw"}


async def _get(http_port: int, path: str) -> Any:
    token = base64.b64encode(f"mallory:{USERS['mallory']}".encode()).decode()
    async with aiohttp.ClientSession(headers={"Authorization": f"Basic {token}"}) as http:
        got = await http.get(f"http://127.0.0.1:{http_port}/api/queues/{path}")
        assert got.status == 200
        return await got.json()


async def _receive(consumer: Consumer, count: int) -> list[Message]:
    async with asyncio.timeout(20):
        return [await consumer.receive() for _ in range(count)]


@pytest.mark.parametrize("attacker", ["alice", "mallory"])
async def test_another_connection_cannot_ack_nack_reject_credit_or_unbind_a_flow(
    db_url: str, attacker: str
) -> None:
    gateway = await start_gateway(
        db_url, users=hashed_users(**USERS), permissions={name: ADMIN for name in USERS}
    )
    url = native_url(gateway)
    try:
        owner = await Client(url, username="alice", password="secret").connect()
        thief = await Client(url, username=attacker, password=USERS[attacker]).connect()
        await owner.declare_queue("orders", partitions=2)
        consumer = await owner.subscribe("orders", group="billing", window=100)
        await eventually(lambda: len(consumer.partitions) == 2)
        first = [await owner.publish("orders", f"m{i}".encode(), key=f"k{i}") for i in range(10)]
        held = await _receive(consumer, 10)
        ((flow,),) = [
            g["flows"] for g in (await _get(gateway.ports["http"], "orders/inspect"))["groups"]
        ]
        flow_id = flow["flow_id"]
        ids = tuple(m.message_id for m in held)
        conn = await thief.session.connection()
        attacks: list[Callable[[int], Event]] = [
            lambda rid: Ack(request_id=rid, flow_id=flow_id, message_ids=ids),
            lambda rid: Nack(request_id=rid, flow_id=flow_id, message_ids=ids, delay=0.0),
            lambda rid: Nack(
                request_id=rid, flow_id=flow_id, message_ids=ids, outcome=NackOutcome.REJECT
            ),
            lambda rid: Nack(
                request_id=rid, flow_id=flow_id, message_ids=(), outcome=NackOutcome.SHUTDOWN
            ),
            lambda rid: Credit(request_id=rid, flow_id=flow_id, window=1),
            lambda rid: Credit(request_id=rid, flow_id=flow_id, window=0),  # would pause it
            lambda rid: Unbind(request_id=rid, flow_id=flow_id, shutdown=True),
            lambda rid: Unbind(request_id=rid, flow_id=flow_id),
        ]
        for attack in attacks:
            with pytest.raises(PermissionDenied, match="flow belongs to another connection"):
                await conn.request(attack)
        # The attacker's connection survives its refusals.
        assert await thief.publish("orders", b"from the attacker", key="k0")

        # No harm: nothing was acked, redelivered or dead-lettered for the owner, its window
        # and partitions are intact, and it goes on receiving everything.
        later = [await owner.publish("orders", f"n{i}".encode(), key=f"k{i}") for i in range(40)]
        more = await _receive(consumer, 41)
        assert sorted(m.message_id for m in held) == sorted(first)
        assert {m.message_id for m in more} >= set(later)
        assert all(m.delivery_count == 1 and not m.redelivered for m in held + more)
        assert consumer.partitions == frozenset({0, 1})
        assert (await _get(gateway.ports["http"], "orders.dlq"))["depth"] == 0
        # Every message is still stored: the attacker acked none of them.
        assert (await _get(gateway.ports["http"], "orders"))["depth"] == 51
        ((flow,),) = [
            g["flows"] for g in (await _get(gateway.ports["http"], "orders/inspect"))["groups"]
        ]
        assert flow["flow_id"] == flow_id and flow["window"] == 100
        await thief.close()
        await owner.close()
    finally:
        await gateway.stop()


@pytest.mark.parametrize("attacker", ["alice", "mallory"])
async def test_a_connections_own_flow_cannot_settle_another_flows_messages(
    db_url: str, attacker: str
) -> None:
    # The thief binds its own flow in the owner's group and names the owner's message ids
    # with it: the flow is the thief's, so only what that flow holds may be settled.
    gateway = await start_gateway(
        db_url, users=hashed_users(**USERS), permissions={name: ADMIN for name in USERS}
    )
    url = native_url(gateway)
    try:
        owner = await Client(url, username="alice", password="secret").connect()
        thief = await Client(url, username=attacker, password=USERS[attacker]).connect()
        await owner.declare_queue("orders", partitions=0)
        consumer = await owner.subscribe("orders", "billing", window=1, mode="shared")
        stolen = await thief.subscribe("orders", "billing", window=1, mode="shared")
        for i in range(2):
            await owner.publish("orders", f"m{i}".encode())
        (held,) = await _receive(consumer, 1)
        (its_own,) = await _receive(stolen, 1)  # its window stays full from here on
        owner_conn = await owner.session.connection()
        thief_conn = await thief.session.connection()

        def ack(message: Message) -> Callable[[int], Event]:
            flow_id = stolen.flow_id or ""
            ids = (message.message_id,)
            return lambda rid: Ack(request_id=rid, flow_id=flow_id, message_ids=ids)

        def nack(message: Message, delay: float) -> Callable[[int], Event]:
            flow_id = consumer.flow_id or ""
            ids = (message.message_id,)
            return lambda rid: Nack(request_id=rid, flow_id=flow_id, message_ids=ids, delay=delay)

        # In flight to the owner: the thief's ACK is a no-op (answered OK, as for any id its
        # flow does not hold), and the owner's NACK still brings the message back.
        await thief_conn.request(ack(held))
        await owner_conn.request(nack(held, 0.0))
        await owner.publish("orders", b"later")  # a retry goes first: it must come before
        (again,) = await _receive(consumer, 1)
        assert (again.message_id, again.delivery_count) == (held.message_id, 2)

        # Waiting for its retry: the thief's ACK does not cancel the retry either.
        await owner_conn.request(nack(again, 1.0))
        await thief_conn.request(ack(again))
        (later,) = await _receive(consumer, 1)  # sent while the retry waits
        assert later.payload == b"later"
        await consumer.acknowledge(later)
        (third,) = await _receive(consumer, 1)
        assert (third.message_id, third.delivery_count) == (held.message_id, 3)
        await consumer.acknowledge(third)
        assert its_own.message_id != held.message_id
        assert (await _get(gateway.ports["http"], "orders.dlq"))["depth"] == 0
        await thief.close()
        await owner.close()
    finally:
        await gateway.stop()
