"""Active/standby failover with real ``keygate serve`` processes on one PostgreSQL schema.

SDK clients list both gateways; when the active one is killed (-9) they follow the
standby once it takes over: nothing confirmed is lost and per-key order holds.

The frozen-active scenario of issue 17: the active gateway is frozen (SIGSTOP) while a
client queues publishes on its socket; the standby takes over; a consumer on it drains;
then the old gateway is thawed. Every publish confirmed by either gateway must be
delivered by the new one, and the old one must exit non-zero (its writes are fenced).
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from contextlib import AbstractContextManager, ExitStack
from pathlib import Path
from subprocess import Popen

import aio_pika
import aiohttp
import pika
import pika.exceptions
import pytest

from gateway.client import Backoff, Client, Consumer
from protocols.mqtt import MQTT_5, Connect, PubComp, Publish, PubRec, PubRel
from tests.support.mqtt_raw import RawMqtt
from tests.support.serve import serve
from tests.support.wait import eventually

pytestmark = pytest.mark.postgres

LEASE_TTL = "2"
QUEUED = 50


async def _publish(client: Client, payload: bytes) -> bytes | None:
    """The payload if the gateway confirmed it, None if it refused or the link broke."""
    try:
        async with asyncio.timeout(60):
            await client.publish("orders", payload, key=f"k{payload[-1] % 5}")
    except Exception:
        return None
    return payload


async def _drain(consumer: Consumer, delivered: set[bytes], until: set[bytes]) -> None:
    """Receive and ack into ``delivered`` until it holds every payload of ``until``."""
    while not until <= delivered:
        message = await consumer.receive(timeout=30)
        delivered.add(message.payload)
        await consumer.acknowledge(message)


@pytest.mark.parametrize("attempt", range(2))
async def test_a_frozen_active_gateway_confirms_nothing_after_the_takeover_and_exits(
    postgres_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, attempt: int
) -> None:
    monkeypatch.setenv("KEYGATE_LEASE_TTL", LEASE_TTL)
    with ExitStack() as stack:
        proc_a, ports_a, log_a = stack.enter_context(serve(postgres_url, tmp_path, name="a"))
        async with Client(f"keygate://127.0.0.1:{ports_a['native']}") as publisher:
            await publisher.declare_queue("orders", partitions=4)
            before = [await _publish(publisher, b"before-%d" % i) for i in range(10)]
            assert all(before)

            os.kill(proc_a.pid, signal.SIGSTOP)
            try:
                queued = [
                    asyncio.create_task(_publish(publisher, b"queued-%d" % i))
                    for i in range(QUEUED)
                ]
                # B waits for A's lease to lapse, takes over and opens its ports.
                _, ports_b, _ = await asyncio.to_thread(
                    stack.enter_context, serve(postgres_url, tmp_path, name="b")
                )
                async with Client(f"keygate://127.0.0.1:{ports_b['native']}") as reader:
                    consumer = await reader.subscribe("orders", group="g", start="earliest")
                    delivered: set[bytes] = set()
                    await _drain(consumer, delivered, {p for p in before if p})
            finally:
                os.kill(proc_a.pid, signal.SIGCONT)

            confirmed = {p for p in await asyncio.gather(*queued) if p}
            assert await asyncio.to_thread(proc_a.wait, 30) != 0, log_a.read_text()
            assert "stopping at once" in log_a.read_text()
            async with Client(f"keygate://127.0.0.1:{ports_b['native']}") as reader:
                consumer = await reader.subscribe("orders", group="g")
                await _drain(consumer, delivered, confirmed)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


async def _health(port: int) -> tuple[int, str] | None:
    """(HTTP status, role) of a gateway's /healthz; None while nothing listens."""
    try:
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"http://127.0.0.1:{port}/healthz") as response,
        ):
            return response.status, (await response.json()).get("role")
    except aiohttp.ClientConnectionError:
        return None


async def test_sdk_clients_follow_the_standby_after_the_active_gateway_is_killed(
    postgres_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KEYGATE_LEASE_TTL", LEASE_TTL)
    native, http = {"a": _free_port(), "b": _free_port()}, {"a": _free_port(), "b": _free_port()}

    def gateway(name: str) -> AbstractContextManager[tuple[Popen[bytes], dict[str, int], Path]]:
        ports = [f"--native-port={native[name]}", f"--http-port={http[name]}"]
        return serve(postgres_url, tmp_path, *ports, name=name)

    url = f"keygate://127.0.0.1:{native['a']},127.0.0.1:{native['b']}"
    fast = Backoff(initial=0.05, maximum=0.5)
    keys, total = 5, 300
    confirmed: list[bytes] = []
    with ExitStack() as stack:
        proc_a, _, _ = stack.enter_context(gateway("a"))
        taking_over = asyncio.create_task(asyncio.to_thread(stack.enter_context, gateway("b")))
        assert await eventually(lambda: _health(http["b"])) == (503, "standby")
        assert await _health(http["a"]) == (200, "active")
        async with (
            Client(url, backoff=fast, heartbeat=1) as publisher,
            Client(url, backoff=fast, heartbeat=1) as reader,
        ):
            await publisher.declare_queue("orders", partitions=4)
            consumer = await reader.subscribe("orders", group="g", window=50)
            received: dict[str, list[int]] = {}
            seen: set[bytes] = set()

            async def consume() -> None:
                while not (len(confirmed) == total and set(confirmed) <= seen):
                    # The last message may arrive before its publisher has its confirm:
                    # look at the condition again (the caller's wait_for is the deadline).
                    try:
                        message = await consumer.receive(timeout=0.5)
                    except TimeoutError:
                        continue
                    if message.payload not in seen:
                        seen.add(message.payload)
                        assert message.key is not None
                        received.setdefault(message.key, []).append(int(message.payload))
                    await consumer.acknowledge(message)

            async def publish() -> None:
                for i in range(total):
                    payload = b"%d" % i
                    # A dedup id makes the SDK resend a publish cut by the failover.
                    await publisher.publish("orders", payload, key=f"k{i % keys}", dedup_id=str(i))
                    confirmed.append(payload)

            consuming = asyncio.create_task(consume())
            publishing = asyncio.create_task(publish())
            await eventually(lambda: len(confirmed) >= total // 3)
            proc_a.kill()
            await asyncio.to_thread(proc_a.wait, 10)
            await asyncio.wait_for(taking_over, 60)
            assert await _health(http["b"]) == (200, "active")
            await asyncio.wait_for(publishing, 60)
            await asyncio.wait_for(consuming, 60)
            assert publisher.session.reconnects == 1 and reader.session.reconnects == 1
    assert set(confirmed) <= seen
    for key, numbers in received.items():
        assert numbers == sorted(numbers), f"key {key} out of order: {numbers}"


async def test_protocol_state_follows_a_failover_after_kill_9(
    postgres_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A QoS 2 PUBLISH re-sent to the new gateway is stored once; an AMQP exchange declared
    on the old one is published to on the new one without declaring it again."""
    monkeypatch.setenv("KEYGATE_LEASE_TTL", LEASE_TTL)
    session = Connect("meter-7", MQTT_5, clean_start=False)
    with ExitStack() as stack:
        proc_a, ports_a, _ = stack.enter_context(serve(postgres_url, tmp_path, name="a"))
        taking_over = asyncio.create_task(
            asyncio.to_thread(stack.enter_context, serve(postgres_url, tmp_path, name="b"))
        )
        async with Client(f"keygate://127.0.0.1:{ports_a['native']}") as admin:
            await admin.declare_queue("readings", partitions=2, subscriptions=["readings/#"])
        amqp = await aio_pika.connect(host="127.0.0.1", port=ports_a["amqp"])
        async with amqp:
            channel = await amqp.channel()
            meters = await channel.declare_exchange("meters", aio_pika.ExchangeType.TOPIC)
            queue = await channel.declare_queue("readings", passive=True)
            await queue.bind(meters, "#")
        mqtt = await RawMqtt.connected(ports_a["mqtt"], session)
        await mqtt.send(Publish("readings/q2", b"qos2", 2, packet_id=9))
        assert await mqtt.receive() == PubRec(9)
        proc_a.kill()  # the PUBREC is "lost" with the gateway: the client re-sends
        mqtt.abort()
        _, ports_b, _ = await asyncio.wait_for(taking_over, 60)

        mqtt = await RawMqtt.connected(ports_b["mqtt"], session)
        assert mqtt.connack.session_present
        await mqtt.send(Publish("readings/q2", b"qos2", 2, dup=True, packet_id=9))
        assert await mqtt.receive() == PubRec(9)
        await mqtt.send(PubRel(9))
        assert await mqtt.receive() == PubComp(9)
        mqtt.abort()
        amqp = await aio_pika.connect(host="127.0.0.1", port=ports_b["amqp"])
        async with amqp:
            channel = await amqp.channel(publisher_confirms=True)
            meters = await channel.get_exchange("meters", ensure=False)
            await meters.publish(aio_pika.Message(b"amqp"), routing_key="readings.x")
        async with Client(f"keygate://127.0.0.1:{ports_b['native']}") as reader:
            consumer = await reader.subscribe("readings", group="audit", start="earliest")
            got = sorted([(await consumer.receive(timeout=10)).payload for _ in range(2)])
            assert got == [b"amqp", b"qos2"]
            with pytest.raises(TimeoutError):
                extra = await consumer.receive(timeout=1.0)
                pytest.fail(f"stored twice: {extra.payload!r}")


def _pika_publisher(ports: list[int], total: int, confirmed: list[bytes]) -> None:
    """What an AMQP user does: pika with both gateways' parameters, confirms on, and a
    retry loop that reconnects (and re-sends the unconfirmed message) on a lost link."""
    parameters = [
        pika.ConnectionParameters("127.0.0.1", port, connection_attempts=1, socket_timeout=5)
        for port in ports
    ]
    i, attempts = 0, 0
    while i < total:
        try:
            connection = pika.BlockingConnection(parameters)
        except pika.exceptions.AMQPConnectionError:
            attempts += 1
            assert attempts < 600, "pika never reached a gateway"
            time.sleep(0.1)  # the user's reconnect backoff, not a test synchronisation
            continue
        try:
            channel = connection.channel()
            channel.confirm_delivery()
            while i < total:
                key = f"k{i % 5}"
                headers = {"JMSXGroupID": key}
                body = b"%d" % i
                channel.basic_publish("", "orders", body, pika.BasicProperties(headers=headers))
                confirmed.append(body)
                i += 1
        except pika.exceptions.AMQPError:
            continue  # lost with the gateway: reconnect and send message i again
        finally:
            if connection.is_open:
                connection.close()


async def test_a_pika_publisher_with_both_addresses_continues_on_the_new_gateway(
    postgres_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KEYGATE_LEASE_TTL", LEASE_TTL)
    amqp = {"a": _free_port(), "b": _free_port()}
    total = 300
    confirmed: list[bytes] = []
    with ExitStack() as stack:
        proc_a, ports_a, _ = stack.enter_context(
            serve(postgres_url, tmp_path, f"--amqp-port={amqp['a']}", name="a")
        )
        taking_over = asyncio.create_task(
            asyncio.to_thread(
                stack.enter_context,
                serve(postgres_url, tmp_path, f"--amqp-port={amqp['b']}", name="b"),
            )
        )
        async with Client(f"keygate://127.0.0.1:{ports_a['native']}") as admin:
            await admin.declare_queue("orders", partitions=4)
        publishing = asyncio.create_task(
            asyncio.to_thread(_pika_publisher, [amqp["a"], amqp["b"]], total, confirmed)
        )
        await eventually(lambda: len(confirmed) >= total // 3)
        proc_a.kill()
        _, ports_b, _ = await asyncio.wait_for(taking_over, 60)
        await asyncio.wait_for(publishing, 60)
        async with Client(f"keygate://127.0.0.1:{ports_b['native']}") as reader:
            consumer = await reader.subscribe("orders", group="g", start="earliest")
            order: dict[str, list[int]] = {}
            seen: set[bytes] = set()
            while not set(confirmed) <= seen:
                message = await consumer.receive(timeout=30)
                if message.payload not in seen:  # a re-sent unconfirmed one may repeat
                    seen.add(message.payload)
                    assert message.key is not None
                    order.setdefault(message.key, []).append(int(message.payload))
                await consumer.acknowledge(message)
    for key, numbers in order.items():
        assert numbers == sorted(numbers), f"key {key} out of order: {numbers}"
