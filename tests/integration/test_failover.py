"""Active/standby failover with real ``keygate serve`` processes on one PostgreSQL schema.

Clients of every protocol list both gateways; when the active one is killed (-9) they
follow the standby once it takes over: nothing confirmed is lost and per-key order holds.

The frozen-active scenario of issue 17: the active gateway is frozen (SIGSTOP) while a
client queues publishes on its socket; the standby takes over; a consumer on it drains;
then the old gateway is thawed. Every publish confirmed by either gateway must be
delivered by the new one, and the old one must exit non-zero (its writes are fenced).
"""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import threading
import time
from contextlib import AbstractContextManager, ExitStack
from pathlib import Path
from subprocess import Popen

import aio_pika
import aiohttp
import pytest

from gateway.client import Backoff, Client, Consumer
from gateway.config import load_config
from protocols.mqtt import MQTT_5, Connect, PubComp, Publish, PubRec, PubRel
from tests.support.mqtt_raw import RawMqtt
from tests.support.publishers import (
    Run,
    paho_publisher,
    pika_publisher,
    sequence,
    stomp_publisher,
)
from tests.support.serve import serve, unused_port
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


async def _sdk_publisher(url: str, run: Run) -> int:
    """The native SDK with both addresses; a dedup id makes it resend a publish cut by the
    failover. Returns its reconnect count."""
    async with Client(url, backoff=Backoff(initial=0.05, maximum=0.5), heartbeat=1) as client:
        while not run.stop.is_set():
            payload, key = run.message()
            await client.publish("orders", payload, key=key, dedup_id=payload.decode())
            run.confirmed.append(payload)
        return client.session.reconnects


async def test_a_default_sdk_client_of_a_frozen_gateway_resumes_on_the_standby_promptly(
    postgres_url: str, tmp_path: Path
) -> None:
    """The active gateway is frozen (SIGSTOP), not killed: no FIN, no RST, its kernel
    still accepts connections. A publisher with the SDK's default settings notices within
    three 2 s heartbeats and has its next confirm from the standby within the bound
    docs/operations.md gives: 4/3 lease_ttl (the takeover) + 8 s. Before, its heartbeat
    (a 15 s ping, a 30 s PONG timeout) held it on the frozen socket for 30-45 s."""
    lease_ttl = load_config(env={}).lease_ttl  # the gateways run with the default
    ports = {name: {p: unused_port() for p in ("native", "http")} for name in ("a", "b")}

    def gateway(name: str) -> AbstractContextManager[tuple[Popen[bytes], dict[str, int], Path]]:
        flags = [f"--{p}-port={port}" for p, port in ports[name].items()]
        return serve(postgres_url, tmp_path, *flags, name=name)

    url = "keygate://" + ",".join(f"127.0.0.1:{ports[n]['native']}" for n in ("a", "b"))
    confirmed: list[float] = []  # when each confirm came (time.monotonic)
    with ExitStack() as stack:
        proc_a, _, _ = stack.enter_context(gateway("a"))
        taking_over = asyncio.create_task(asyncio.to_thread(stack.enter_context, gateway("b")))
        assert await eventually(lambda: _health(ports["b"]["http"])) == (503, "standby")
        async with Client(url) as client:  # every setting its default
            await client.declare_queue("orders", partitions=2)

            async def publish() -> None:
                for i in itertools.count():
                    # With a dedup id the SDK resends a publish the freeze cut.
                    await client.publish("orders", b"%d" % i, dedup_id=str(i))
                    confirmed.append(time.monotonic())
                    await asyncio.sleep(0.05)

            publishing = asyncio.create_task(publish())
            await eventually(lambda: len(confirmed) >= 20, timeout=30)
            os.kill(proc_a.pid, signal.SIGSTOP)
            frozen = time.monotonic()
            try:
                await eventually(lambda: confirmed[-1] > frozen, timeout=90)
                resumed = confirmed[-1] - frozen
                await asyncio.wait_for(taking_over, 30)
                assert await _health(ports["b"]["http"]) == (200, "active")
                assert client.session.reconnects == 1
            finally:
                os.kill(proc_a.pid, signal.SIGCONT)
                publishing.cancel()
                await asyncio.gather(publishing, return_exceptions=True)
    assert resumed < 4 / 3 * lease_ttl + 8, f"first confirm {resumed:.1f} s after the freeze"


async def test_every_client_follows_the_standby_after_the_active_gateway_is_killed(
    postgres_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kill -9 of the active gateway while native, MQTT (paho, QoS 1), AMQP (pika,
    confirms) and STOMP (stomp.py, receipts) publishers and an SDK consumer run, each with
    both gateways' addresses: every confirmed message is delivered, each publisher's keys
    keep their order, and every client goes on through the new active gateway."""
    monkeypatch.setenv("KEYGATE_LEASE_TTL", LEASE_TTL)
    protocols = ("native", "mqtt", "amqp", "stomp", "http")
    ports = {name: {p: unused_port() for p in protocols} for name in ("a", "b")}

    def gateway(name: str) -> AbstractContextManager[tuple[Popen[bytes], dict[str, int], Path]]:
        flags = [f"--{p}-port={port}" for p, port in ports[name].items()]
        return serve(postgres_url, tmp_path, *flags, name=name)

    def both(protocol: str) -> list[int]:
        return [ports["a"][protocol], ports["b"][protocol]]

    url = "keygate://" + ",".join(f"127.0.0.1:{port}" for port in both("native"))
    stop, deadline = threading.Event(), time.monotonic() + 180
    runs = {
        name: Run(name, both(name), stop, deadline) for name in ("native", "mqtt", "amqp", "stomp")
    }
    with ExitStack() as stack:
        proc_a, _, _ = stack.enter_context(gateway("a"))
        taking_over = asyncio.create_task(asyncio.to_thread(stack.enter_context, gateway("b")))
        assert await eventually(lambda: _health(ports["b"]["http"])) == (503, "standby")
        async with Client(url) as admin:
            await admin.declare_queue("orders", partitions=4, subscriptions=["orders/#"])
        async with Client(url, backoff=Backoff(initial=0.05, maximum=0.5), heartbeat=1) as reader:
            consumer = await reader.subscribe("orders", group="g", window=50)
            order: dict[str, list[int]] = {}
            seen: set[bytes] = set()

            async def consume() -> None:
                while not (
                    published.is_set() and all(set(r.confirmed) <= seen for r in runs.values())
                ):
                    try:  # re-check the condition now and then (wait_for is the deadline)
                        message = await consumer.receive(timeout=0.5)
                    except TimeoutError:
                        continue
                    if message.payload not in seen:  # a message sent twice may repeat
                        seen.add(message.payload)
                        assert message.key is not None
                        order.setdefault(message.key, []).append(sequence(message.payload)[1])
                    await consumer.acknowledge(message)

            published = asyncio.Event()  # every publisher has returned
            consuming = asyncio.create_task(consume())
            publishing = [
                asyncio.create_task(_sdk_publisher(url, runs["native"])),
                *(
                    asyncio.create_task(asyncio.to_thread(publisher, runs[name]))
                    for name, publisher in (
                        ("mqtt", paho_publisher),
                        ("amqp", pika_publisher),
                        ("stomp", stomp_publisher),
                    )
                ),
            ]
            await eventually(lambda: all(len(r.confirmed) >= 20 for r in runs.values()), timeout=60)
            proc_a.kill()
            await asyncio.to_thread(proc_a.wait, 10)
            before = {name: len(run.confirmed) for name, run in runs.items()}
            await asyncio.wait_for(taking_over, 60)
            assert await _health(ports["b"]["http"]) == (200, "active")
            # Every client goes on through B: each has confirms from it.
            await eventually(
                lambda: all(len(r.confirmed) >= before[n] + 20 for n, r in runs.items()), timeout=60
            )
            stop.set()
            sdk_reconnects, *_ = await asyncio.wait_for(asyncio.gather(*publishing), 60)
            published.set()
            await asyncio.wait_for(consuming, 60)
            assert sdk_reconnects == 1 and reader.session.reconnects == 1
    for run in runs.values():
        assert set(run.confirmed) <= seen, f"{run.name}: confirmed messages lost"
    for key, numbers in order.items():
        assert numbers == sorted(numbers), f"key {key} out of order: {numbers}"
    assert {key.rpartition("-")[0] for key in order} == set(runs)


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
