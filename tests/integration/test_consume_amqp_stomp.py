"""Consuming over AMQP 0-9-1 and STOMP with keygate's group semantics (DESIGN.md §5b):
real pika, aio-pika and stomp.py consumers beside the SDK, on SQLite and PostgreSQL.

What a user checks: consumers of every protocol share one group's partitions with
per-key order and no loss; a consumer whose socket drops loses its partitions after the
rebalance delay and its unacked messages come back flagged redelivered; a nacked message
is retried with backoff and dead-lettered after max_deliveries; prefetch caps what a
consumer holds; basic.get polls.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections import defaultdict

import aio_pika
import pika
import pytest

from gateway.client import Client, Consumer, Message
from gateway.logs import JsonFormatter
from gateway.server import Gateway
from tests.integration.conftest import native_url
from tests.integration.sqlcheck import declare
from tests.support.amqp import pika_channel
from tests.support.consumers import PikaConsumer, Received, StompConsumer, wait_until
from tests.support.proxy import TcpProxy

PARTITIONS = 8
KEYS = 24
WAIT = 20.0


async def _publish(gateway: Gateway, queue: str, count: int) -> None:
    """``count`` messages over KEYS keys; the body is ``key:n`` with n counting per key."""
    async with Client(native_url(gateway)) as client:
        for i in range(count):
            key = f"k{i % KEYS}"
            await client.publish(queue, f"{key}:{i // KEYS}".encode(), key=key)


def _owners(gateway: Gateway, queue: str, group: str) -> list[int]:
    """How many partitions each bound flow of the group holds."""
    runtimes = [rt for rt in gateway.broker.runtimes(queue) if rt.group.name == group]
    if not runtimes:
        return []
    return sorted(len(flow.partitions) for flow in runtimes[0].status().flows)


def _check_order(bodies: list[bytes]) -> None:
    """Per key, the messages arrive in publish order (first deliveries)."""
    seen: dict[str, list[int]] = defaultdict(list)
    for body in bodies:
        key, n = body.decode().split(":")
        if int(n) not in seen[key]:
            seen[key].append(int(n))
    for key, order in seen.items():
        assert order == sorted(order), (key, order)


async def _drain_sdk(consumer: Consumer, into: list[bytes], stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            message = await consumer.receive(timeout=0.2)
        except TimeoutError:
            continue
        into.append(message.payload)
        await consumer.acknowledge(message)


async def test_sdk_pika_aio_pika_and_stomp_consumers_share_a_group_in_key_order(
    gateway: Gateway,
) -> None:
    await declare(gateway, "mixed", partitions=PARTITIONS, rebalance_delay=0.5)
    total = 480
    sdk_got: list[bytes] = []
    aio_got: list[bytes] = []
    stop = asyncio.Event()
    async with Client(native_url(gateway)) as client:
        sdk = await client.subscribe("mixed", "g")
        pika_consumer = await asyncio.to_thread(
            lambda: PikaConsumer(gateway.ports["amqp"], "mixed", group="g", prefetch=50).start()
        )
        stomp_consumer = await asyncio.to_thread(
            StompConsumer, gateway, "mixed", group="g", prefetch=50
        )
        connection = await aio_pika.connect(
            f"amqp://guest:guest@127.0.0.1:{gateway.ports['amqp']}/"
        )
        try:
            channel = await connection.channel()
            await channel.set_qos(prefetch_count=50)
            queue = await channel.get_queue("mixed", ensure=False)

            async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
                aio_got.append(message.body)
                await message.ack()

            await queue.consume(on_message, arguments={"x-group": "g"})
            await asyncio.to_thread(
                wait_until, lambda: _owners(gateway, "mixed", "g") == [2, 2, 2, 2], WAIT, "balance"
            )
            drain = asyncio.create_task(_drain_sdk(sdk, sdk_got, stop))
            await _publish(gateway, "mixed", total)

            def everything() -> bool:
                got = len(sdk_got) + len(aio_got)
                return got + len(pika_consumer.snapshot()) + len(stomp_consumer.snapshot()) >= total

            await asyncio.to_thread(wait_until, everything, WAIT, "all deliveries")
            stop.set()
            await drain
        finally:
            await connection.close()
            await asyncio.to_thread(pika_consumer.stop)
            await asyncio.to_thread(stomp_consumer.stop)
    pika_got = [r.body for r in pika_consumer.snapshot()]
    stomp_got = [r.body for r in stomp_consumer.snapshot()]
    everyone = [sdk_got, pika_got, stomp_got, aio_got]
    assert all(everyone), [len(x) for x in everyone]  # each holds two partitions
    assert sorted(b for got in everyone for b in got) == sorted(
        f"k{i % KEYS}:{i // KEYS}".encode() for i in range(total)
    )
    for got in everyone:
        _check_order(got)
    # A key is never split between consumers: its partition has one owner.
    owner = {b.split(b":")[0]: n for n, got in enumerate(everyone) for b in got}
    for n, got in enumerate(everyone):
        assert all(owner[b.split(b":")[0]] == n for b in got)


async def test_a_dropped_amqp_consumer_s_partitions_move_and_its_unacked_are_redelivered(
    gateway: Gateway,
) -> None:
    await declare(gateway, "crash", partitions=PARTITIONS, rebalance_delay=0.5)
    async with TcpProxy(gateway.ports["amqp"]) as proxy, Client(native_url(gateway)) as client:
        holder = await asyncio.to_thread(
            lambda: PikaConsumer(proxy.port, "crash", group="g", policy=lambda _: "hold").start()
        )
        await asyncio.to_thread(
            wait_until, lambda: _owners(gateway, "crash", "g") == [8], WAIT, "the pika consumer"
        )
        await _publish(gateway, "crash", 48)
        held = await asyncio.to_thread(holder.wait_for, 48)
        assert not any(r.redelivered for r in held)
        sdk = await client.subscribe("crash", "g")
        proxy.cut()  # an RST on both sides: the consumer "crashed"
        got = []
        async with asyncio.timeout(WAIT):
            while len(got) < 48:
                message = await sdk.receive(timeout=WAIT)
                got.append(message)
                await sdk.acknowledge(message)
        await asyncio.to_thread(holder.stop)
    assert sorted(m.payload for m in got) == sorted(r.body for r in held)
    assert all(m.redelivered and m.delivery_count == 2 for m in got)
    _check_order([m.payload for m in got])


async def test_amqp_nack_retries_with_backoff_then_dead_letters_and_stomp_nack_retries(
    gateway: Gateway,
) -> None:
    await declare(gateway, "retry", partitions=2, max_deliveries=3, backoff_initial=0.05)
    nacker = await asyncio.to_thread(
        lambda: PikaConsumer(gateway.ports["amqp"], "retry", policy=lambda _: "nack").start()
    )
    try:
        async with Client(native_url(gateway)) as client:
            await client.publish("retry", b"poison", key="p")
            seen = await asyncio.to_thread(nacker.wait_for, 3)
            dead = await client.subscribe("retry.dlq", "ops")
            letter = await dead.receive(timeout=WAIT)
            await dead.acknowledge(letter)
    finally:
        await asyncio.to_thread(nacker.stop)
    assert [(r.redelivered, r.headers["x-delivery-count"]) for r in seen] == [
        (False, 1),
        (True, 2),
        (True, 3),
    ]
    assert letter.payload == b"poison"
    assert letter.properties["x-delivery-count"] == 3
    assert letter.properties["x-original-queue"] == "retry"

    await declare(gateway, "stomp-retry", partitions=1, max_deliveries=5, backoff_initial=0.05)
    answers = iter(["nack", "ack"])
    stomp_consumer = await asyncio.to_thread(
        StompConsumer, gateway, "stomp-retry", policy=lambda _: next(answers)
    )
    try:
        async with Client(native_url(gateway)) as client:
            await client.publish("stomp-retry", b"twice", key="s")
        seen = await asyncio.to_thread(stomp_consumer.wait_for, 2)
    finally:
        await asyncio.to_thread(stomp_consumer.stop)
    assert [(r.body, r.redelivered, r.headers["x-delivery-count"]) for r in seen] == [
        (b"twice", False, "1"),
        (b"twice", True, "2"),
    ]


async def test_amqp_reject_without_requeue_dead_letters_at_once(gateway: Gateway) -> None:
    await declare(gateway, "reject", partitions=1, max_deliveries=5)
    rejecter = await asyncio.to_thread(
        lambda: PikaConsumer(gateway.ports["amqp"], "reject", policy=lambda _: "reject").start()
    )
    try:
        async with Client(native_url(gateway)) as client:
            await client.publish("reject", b"bad", key="r")
            await asyncio.to_thread(rejecter.wait_for, 1)
            dead = await client.subscribe("reject.dlq", "ops")
            letter = await dead.receive(timeout=WAIT)
    finally:
        await asyncio.to_thread(rejecter.stop)
    assert letter.payload == b"bad"
    assert letter.properties["x-delivery-count"] == 1


async def test_acks_after_basic_cancel_settle_what_the_cancelled_consumer_held(
    gateway: Gateway,
) -> None:
    """The graceful shutdown of a RabbitMQ consumer: basic.cancel, finish the work in hand,
    ack it. As in RabbitMQ those acks count (the deliveries stay the channel's), so a new
    consumer gets only what was never delivered, nothing again."""
    await declare(gateway, "graceful", partitions=1)
    await _publish(gateway, "graceful", 5)
    connection = await aio_pika.connect(f"amqp://guest:guest@127.0.0.1:{gateway.ports['amqp']}/")
    try:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=3)
        queue = await channel.get_queue("graceful", ensure=False)
        held: list[aio_pika.abc.AbstractIncomingMessage] = []
        three = asyncio.Event()

        async def hold(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            held.append(message)
            if len(held) == 3:
                three.set()

        tag = await queue.consume(hold)
        await asyncio.wait_for(three.wait(), WAIT)
        await queue.cancel(tag)
        for message in held:
            await message.ack()
        rest = []
        async with queue.iterator() as messages:
            async for message in messages:
                rest.append(message)
                await message.ack()
                if len(rest) == 2:
                    break
    finally:
        await connection.close()
    assert [m.body for m in held + rest] == [f"k{i}:0".encode() for i in range(5)]
    assert not any(m.redelivered for m in rest)
    runtime = gateway.broker.runtimes("graceful")[0]
    await asyncio.to_thread(
        wait_until,
        lambda: [p.committed_seq for p in runtime.status().partitions] == [5],
        WAIT,
        "all five acked",
    )


def _cancel_then_settle(gateway: Gateway, queue: str, answers: str) -> list[bytes]:
    """pika, prefetch 5: hold five deliveries, basic.cancel, then settle them back to back
    (no I/O between the calls, so the gateway reads them together), one letter each:
    a = ack, n = nack(requeue), r = reject(requeue=False). Returns the held bodies once
    the cancelled consumer's flow is gone."""
    with pika_channel(gateway, confirm=False) as (connection, channel):
        channel.basic_qos(prefetch_count=5)
        held: list[tuple[int, bytes]] = []
        tag = channel.basic_consume(
            queue,
            lambda _, method, __, body: held.append((method.delivery_tag, body)),
            arguments={"x-group": "g"},
        )
        deadline = time.monotonic() + WAIT
        while len(held) < 5:
            assert time.monotonic() < deadline, f"{len(held)} of 5 deliveries"
            connection.process_data_events(time_limit=0.05)
        channel.basic_cancel(tag)
        for (delivery_tag, _), answer in zip(held, answers, strict=True):
            if answer == "a":
                channel.basic_ack(delivery_tag)
            elif answer == "n":
                channel.basic_nack(delivery_tag, requeue=True)
            else:
                channel.basic_reject(delivery_tag, requeue=False)
        wait_until(lambda: _owners(gateway, queue, "g") == [], WAIT, "the cancelled flow gone")
    return [body for _, body in held]


@pytest.mark.parametrize("answers", ["aaaaa", "anara"])
async def test_settles_sent_back_to_back_after_basic_cancel_all_count(
    gateway: Gateway, answers: str
) -> None:
    """QA's repro: acks (and nacks, rejects) of the held deliveries in a tight loop after
    basic.cancel. Each counts: the next consumer gets what was never delivered and the
    nacked ones, nothing acked or rejected again."""
    queue = f"tight-{answers}"
    await declare(gateway, queue, partitions=1, rebalance_delay=0.5, backoff_initial=0)
    await _publish(gateway, queue, 20)
    held = await asyncio.to_thread(_cancel_then_settle, gateway, queue, answers)
    nacked = [body for body, answer in zip(held, answers, strict=True) if answer == "n"]
    rejected = [body for body, answer in zip(held, answers, strict=True) if answer == "r"]
    never = [f"k{i}:0".encode() for i in range(5, 20)]
    async with Client(native_url(gateway)) as client:
        consumer = await client.subscribe(queue, "g", window=100)
        got: list[Message] = []
        deadline = time.monotonic() + WAIT
        while len(got) < len(never) + len(nacked) and time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):
                got.append(await consumer.receive(timeout=0.2))
                await consumer.acknowledge(got[-1])
        assert sorted(m.payload for m in got) == sorted(never + nacked)
        assert sorted(m.payload for m in got if m.redelivered) == sorted(nacked)
        runtime = gateway.broker.runtimes(queue)[0]
        await asyncio.to_thread(
            wait_until,
            lambda: [p.committed_seq for p in runtime.status().partitions] == [20],
            WAIT,
            "all twenty settled",
        )
        if rejected:
            letter = await (await client.subscribe(f"{queue}.dlq", "ops")).receive(timeout=WAIT)
            assert [letter.payload] == rejected


async def test_prefetch_caps_the_unacked_deliveries_of_a_consumer(gateway: Gateway) -> None:
    await declare(gateway, "capped", partitions=1)
    await _publish(gateway, "capped", 10)
    holder = await asyncio.to_thread(
        lambda: PikaConsumer(
            gateway.ports["amqp"], "capped", prefetch=3, policy=lambda _: "hold"
        ).start()
    )
    try:
        first = await asyncio.to_thread(holder.wait_for, 3)
        runtime = gateway.broker.runtimes("capped")[0]
        # The group delivered three and holds the rest back for the window.
        assert sum(p.in_flight for p in runtime.status().partitions) == 3
        assert len(holder.snapshot()) == 3
        holder.ack(first[0].tag)
        fourth = await asyncio.to_thread(holder.wait_for, 4)
        assert len(fourth) == 4
        await asyncio.to_thread(
            wait_until,
            lambda: sum(p.in_flight for p in runtime.status().partitions) == 3,
            WAIT,
            "the window refilled",
        )
        assert len(holder.snapshot()) == 4
    finally:
        await asyncio.to_thread(holder.stop)
    _check_order([r.body for r in holder.snapshot()])


async def test_basic_get_polls_the_default_group(gateway: Gateway) -> None:
    await declare(gateway, "polled", partitions=1)
    async with Client(native_url(gateway)) as client:
        await client.publish("polled", b"one", key="a")
        await client.publish("polled", b"two", key="a")

    def poll() -> list[tuple[bytes | None, bool]]:
        connection = pika.BlockingConnection(
            pika.ConnectionParameters("127.0.0.1", gateway.ports["amqp"], connection_attempts=1)
        )
        try:
            channel = connection.channel()
            results = []
            for _ in range(3):
                method, properties, body = channel.basic_get("polled")
                if method is None:
                    results.append((None, False))
                    continue
                results.append((body, properties.headers["x-partition"] == 0))
                channel.basic_ack(method.delivery_tag)
            return results
        finally:
            connection.close()

    assert await asyncio.to_thread(poll) == [(b"one", True), (b"two", True), (None, False)]


async def test_deleting_the_queue_cancels_its_amqp_consumers(gateway: Gateway) -> None:
    await declare(gateway, "doomed", partitions=2)
    cancelled = threading.Event()
    ready = threading.Event()

    def consumer() -> None:
        connection = pika.BlockingConnection(
            pika.ConnectionParameters("127.0.0.1", gateway.ports["amqp"], connection_attempts=1)
        )
        try:
            channel = connection.channel()
            channel.add_on_cancel_callback(lambda frame: cancelled.set())
            channel.basic_consume("doomed", lambda *args: None)
            ready.set()
            deadline = time.monotonic() + WAIT
            while not cancelled.is_set() and time.monotonic() < deadline:
                connection.process_data_events(time_limit=0.1)
        finally:
            connection.close()

    running = asyncio.create_task(asyncio.to_thread(consumer))
    assert await asyncio.to_thread(ready.wait, WAIT)
    await asyncio.to_thread(wait_until, lambda: _owners(gateway, "doomed", "default") == [2])
    async with Client(native_url(gateway)) as admin:
        await admin.delete_queue("doomed")
    await running
    assert cancelled.is_set()


async def test_log_lines_of_a_stomp_consumer_carry_its_flow_client_and_protocol(
    gateway: Gateway, caplog: pytest.LogCaptureFixture
) -> None:
    """What a log pipeline filters on (log_json): the JSON keys of each line."""
    await declare(gateway, "logged", partitions=1)
    caplog.set_level(logging.INFO)
    consumer = await asyncio.to_thread(StompConsumer, gateway, "logged", group="audit")
    await asyncio.to_thread(consumer.stop)
    await asyncio.to_thread(
        wait_until,
        lambda: any("unbound" in r.getMessage() for r in caplog.records),
        WAIT,
        "the unbind line",
    )
    entries = [json.loads(JsonFormatter().format(r)) for r in caplog.records]
    bound = [e for e in entries if e.get("flow") and "bound by" in e["message"]]
    assert len(bound) == 1
    entry = bound[0]
    assert (entry["queue"], entry["group"], entry["protocol"]) == ("logged", "audit", "stomp")
    assert entry["client"].startswith("stomp:")
    subscribed = [e for e in entries if "subscription" in e["message"] and e.get("flow")]
    assert subscribed and subscribed[0]["flow"] == entry["flow"]
    assert subscribed[0]["protocol"] == "stomp" and subscribed[0]["peer"].startswith("127.0.0.1")
    unbound = [e for e in entries if "unbound" in e["message"]]
    assert unbound[0]["flow"] == entry["flow"]
    # A pipeline filtering on client finds both ends of the flow (QA D6b).
    assert set(unbound[0]) == set(entry)
    assert unbound[0]["client"] == entry["client"]


async def test_the_bound_and_unbound_lines_of_a_native_flow_carry_the_same_keys(
    gateway: Gateway, caplog: pytest.LogCaptureFixture
) -> None:
    await declare(gateway, "logged", partitions=1)
    caplog.set_level(logging.INFO)
    async with Client(native_url(gateway), client_name="logger-1") as client:
        consumer = await client.subscribe("logged", "audit")
        await consumer.close()
    await asyncio.to_thread(
        wait_until,
        lambda: any("unbound" in r.getMessage() for r in caplog.records),
        WAIT,
        "the unbind line",
    )
    entries = [json.loads(JsonFormatter().format(r)) for r in caplog.records]
    (bound,) = [e for e in entries if e.get("flow") and "bound by" in e["message"]]
    (unbound,) = [e for e in entries if e.get("flow") and "unbound" in e["message"]]
    assert set(unbound) == set(bound)
    assert unbound["client"] == bound["client"] and "logger-1" in bound["client"]
    assert unbound["protocol"] == "native" and unbound["queue"] == "logged"


@pytest.mark.parametrize("ack", ["client", "auto"])
async def test_stomp_cumulative_and_auto_ack_settle_everything(gateway: Gateway, ack: str) -> None:
    queue = f"stomp-{ack}"
    await declare(gateway, queue, partitions=1)
    await _publish(gateway, queue, 6)
    last: list[Received] = []

    def on_each(item: Received) -> str:
        last.append(item)
        return "hold"

    consumer = await asyncio.to_thread(StompConsumer, gateway, queue, policy=on_each, ack=ack)
    try:
        got = await asyncio.to_thread(consumer.wait_for, 6)
        if ack == "client":
            consumer.conn.ack(got[-1].tag)  # cumulative: everything up to it
        runtime = gateway.broker.runtimes(queue)[0]
        await asyncio.to_thread(
            wait_until,
            lambda: sum(p.in_flight for p in runtime.status().partitions) == 0,
            WAIT,
            "all settled",
        )
    finally:
        await asyncio.to_thread(consumer.stop)
    assert [r.body for r in got] == [f"k{i}:0".encode() for i in range(6)]
