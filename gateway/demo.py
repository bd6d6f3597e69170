"""``keygate demo``: a real gateway with real traffic, verified end to end.

On a temporary SQLite file and free loopback ports it starts a gateway, creates a
partitioned queue, publishes keyed messages with every protocol (native SDK, MQTT 5 via
paho, AMQP 0-9-1 via pika, STOMP 1.2 via stomp.py — each key always from the same
publisher, so its order is defined), consumes them with three SDK consumers and one AMQP
consumer (pika) in one group, kills an SDK consumer mid-stream (its socket is dropped, no
goodbye) and shows the rebalance,
sends a poison message to the dead-letter queue, and finally checks that every key was
processed in publish order and nothing was lost.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from gateway.admin_commands import print_inspection
from gateway.client import Client, Consumer
from gateway.config import LISTENERS, load_config
from gateway.inspect import inspect_queue
from gateway.server import Gateway

QUEUE: Final = "orders"
GROUP: Final = "billing"
PARTITIONS: Final = 8
KEYS: Final = 40
PROTOCOLS: Final = ("native", "mqtt", "amqp", "stomp")
MAX_DELIVERIES: Final = 3


@dataclass
class Tally:
    """What the consumers processed: per key, the sequence numbers in processing order."""

    processed: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    redelivered: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def unique(self) -> int:
        return sum(len(set(seqs)) for seqs in self.processed.values())

    def record(self, key: str, n: int, redelivered: bool) -> None:
        self.processed[key].append(n)
        self.redelivered += redelivered
        self.changed.set()


def _payload(key: str, n: int) -> bytes:
    return json.dumps({"key": key, "n": n}).encode()


def _keys_of(protocol: str) -> list[str]:
    index = PROTOCOLS.index(protocol)
    return [f"customer-{i}" for i in range(KEYS) if i % len(PROTOCOLS) == index]


def _plan(protocol: str, per_key: int) -> list[tuple[str, int]]:
    return [(key, n) for n in range(per_key) for key in _keys_of(protocol)]


def publish_mqtt(port: int, plan: list[tuple[str, int]]) -> None:
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion
    from paho.mqtt.packettypes import PacketTypes
    from paho.mqtt.properties import Properties

    client = mqtt.Client(CallbackAPIVersion.VERSION2, "demo-mqtt", protocol=mqtt.MQTTv5)
    client.max_inflight_messages_set(100)
    client.connect("127.0.0.1", port)
    client.loop_start()
    try:
        infos = []
        for key, n in plan:
            props = Properties(PacketTypes.PUBLISH)
            props.UserProperty = [("JMSXGroupID", key)]
            infos.append(client.publish("orders/eu", _payload(key, n), qos=1, properties=props))
        for info in infos:
            info.wait_for_publish(timeout=30)
            if not info.is_published():
                raise RuntimeError("an MQTT publish was not acknowledged")
    finally:
        client.loop_stop()
        client.disconnect()


def publish_amqp(port: int, plan: list[tuple[str, int]]) -> None:
    import pika

    credentials = pika.PlainCredentials("guest", "guest")
    params = pika.ConnectionParameters("127.0.0.1", port, credentials=credentials)
    connection = pika.BlockingConnection(params)
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        for key, n in plan:
            channel.basic_publish(
                "",
                QUEUE,
                _payload(key, n),
                pika.BasicProperties(headers={"JMSXGroupID": key}, delivery_mode=2),
            )
    finally:
        connection.close()


def publish_stomp(port: int, plan: list[tuple[str, int]]) -> None:
    import stomp

    done = threading.Event()

    class _Receipts(stomp.ConnectionListener):  # type: ignore[misc]
        def on_receipt(self, frame: Any) -> None:
            if frame.headers.get("receipt-id") == "last":
                done.set()

    connection = stomp.Connection12([("127.0.0.1", port)], heartbeats=(0, 0))
    connection.set_listener("receipts", _Receipts())
    connection.connect(wait=True)
    try:
        for i, (key, n) in enumerate(plan):
            headers = {"JMSXGroupID": key}
            if i == len(plan) - 1:
                headers["receipt"] = "last"
            connection.send(f"/queue/{QUEUE}", _payload(key, n), headers=headers)
        if not done.wait(30):
            raise RuntimeError("the STOMP receipt for the last message did not arrive")
    finally:
        connection.disconnect()


def consume_amqp(
    port: int, loop: asyncio.AbstractEventLoop, tally: Tally, stop: threading.Event
) -> None:
    """An unchanged pika consumer in the group: basic.qos is its window, a poison message
    is nacked with requeue (retried with backoff, then dead-lettered)."""
    import pika

    credentials = pika.PlainCredentials("guest", "guest")
    params = pika.ConnectionParameters("127.0.0.1", port, credentials=credentials)
    connection = pika.BlockingConnection(params)

    def on_message(channel: Any, method: Any, properties: Any, payload: bytes) -> None:
        body = json.loads(payload)
        if body.get("poison"):
            channel.basic_nack(method.delivery_tag, requeue=True)
            return
        loop.call_soon_threadsafe(tally.record, body["key"], body["n"], method.redelivered)
        channel.basic_ack(method.delivery_tag)

    try:
        channel = connection.channel()
        channel.basic_qos(prefetch_count=20)
        channel.basic_consume(QUEUE, on_message, arguments={"x-group": GROUP})
        while not stop.is_set():
            connection.process_data_events(time_limit=0.1)
    finally:
        connection.close()


async def publish_native(url: str, plan: list[tuple[str, int]]) -> None:
    async with Client(url, client_name="demo-native") as client:
        # Pipelined on one connection: stored in the order sent.
        await asyncio.gather(*(client.publish(QUEUE, _payload(k, n), key=k) for k, n in plan))


async def consume(consumer: Consumer, tally: Tally, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            msg = await consumer.receive(timeout=0.2)
        except TimeoutError:
            continue
        body = json.loads(msg.payload)
        if body.get("poison"):
            await consumer.negative_acknowledge(msg)
            continue
        tally.record(body["key"], body["n"], msg.redelivered)
        await consumer.acknowledge(msg)


async def _wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def verify(tally: Tally, per_key: int) -> list[str]:
    """Problems found: a key processed out of publish order, or a message never processed."""
    problems = []
    for i in range(KEYS):
        key = f"customer-{i}"
        first_seen: list[int] = []
        for n in tally.processed.get(key, []):
            if n not in first_seen:
                first_seen.append(n)
        if first_seen != list(range(per_key)):
            problems.append(f"{key}: processed {first_seen[:12]}... expected 0..{per_key - 1}")
    return problems


def _owners(gateway: Gateway) -> dict[str, frozenset[int]]:
    """The group's flows by client, with the partitions each holds."""
    assert gateway.broker is not None
    (runtime,) = [rt for rt in gateway.broker.runtimes(QUEUE) if rt.group.name == GROUP]
    return {flow.client: flow.partitions for flow in runtime.status().flows}


async def _show(gateway: Gateway, title: str) -> None:
    assert gateway.broker is not None and gateway.store is not None
    print(f"\n--- {title}")
    print_inspection(await inspect_queue(gateway.broker, gateway.store, QUEUE))


async def run_demo(messages: int = 3000) -> int:
    per_key = max(1, messages // KEYS)
    with tempfile.TemporaryDirectory(prefix="keygate-demo-") as tmp:
        overrides: dict[str, Any] = {f"{name}_port": 0 for name in LISTENERS}
        overrides.update(db=f"sqlite:///{Path(tmp) / 'demo.db'}", host="127.0.0.1")
        gateway = Gateway(load_config(env={}, overrides=overrides))
        await gateway.start()
        try:
            return await _scenario(gateway, per_key)
        finally:
            await gateway.stop()


async def _scenario(gateway: Gateway, per_key: int) -> int:
    ports = gateway.ports
    url = f"keygate://127.0.0.1:{ports['native']}"
    print(
        "keygate demo: gateway on SQLite, listeners "
        + ", ".join(f"{name}={port}" for name, port in ports.items())
    )
    admin = Client(url, client_name="demo-admin")
    await admin.connect()
    await admin.declare_queue(
        QUEUE,
        partitions=PARTITIONS,
        subscriptions=["orders/#"],
        max_deliveries=MAX_DELIVERIES,
        rebalance_delay=1.0,
        max_handoff_time=1.0,
        backoff_initial=0.05,
        backoff_max=0.2,
    )
    tally, stop = Tally(), asyncio.Event()
    clients = [Client(url, client_name=f"consumer-{i}") for i in (1, 2, 3)]
    consumers = []
    for client in clients:
        await client.connect()
        consumers.append(await client.subscribe(QUEUE, group=GROUP, window=20))
    workers = [asyncio.create_task(consume(c, tally, stop)) for c in consumers]
    amqp_stop = threading.Event()
    amqp_consumer = asyncio.create_task(
        asyncio.to_thread(consume_amqp, ports["amqp"], asyncio.get_running_loop(), tally, amqp_stop)
    )
    await _wait_for(
        lambda: len(_owners(gateway)) == 4 and all(_owners(gateway).values()),
        10,
        "the four consumers",
    )
    await _show(gateway, "three SDK consumers and one AMQP consumer share the 8 partitions")

    total = per_key * KEYS
    print(f"\npublishing {total} messages for {KEYS} keys over {', '.join(PROTOCOLS)} ...")
    started = time.monotonic()
    publishers = [
        publish_native(url, _plan("native", per_key)),
        asyncio.to_thread(publish_mqtt, ports["mqtt"], _plan("mqtt", per_key)),
        asyncio.to_thread(publish_amqp, ports["amqp"], _plan("amqp", per_key)),
        asyncio.to_thread(publish_stomp, ports["stomp"], _plan("stomp", per_key)),
    ]
    publishing = asyncio.gather(*publishers)

    await _wait_for(lambda: tally.unique() >= total // 4, 60, "a quarter of the messages")
    victim = clients[2]
    held = sorted(consumers[2].partitions)
    victim.abort()
    workers[2].cancel()
    print(f"\nconsumer-3 crashed (socket dropped) holding partitions {held}")
    await asyncio.sleep(0.3)
    await _show(gateway, "its partitions are unbound for the rebalance delay (1 s)")
    await _wait_for(
        lambda: (
            len(_owners(gateway)) == 3
            and sum(len(p) for p in _owners(gateway).values()) == PARTITIONS
        ),
        10,
        "the rebalance",
    )
    await _show(gateway, "after the delay: reassigned to the three survivors")

    await publishing
    publish_seconds = time.monotonic() - started
    await admin.publish(QUEUE, json.dumps({"poison": True}).encode(), key="poison-pill")
    await _wait_for(lambda: tally.unique() >= total, 60, "every message to be processed")

    dlq = await admin.subscribe(f"{QUEUE}.dlq", group="ops", window=10)
    letter = await dlq.receive(timeout=30)
    await dlq.acknowledge(letter)
    history = {name: str(value) for name, value in letter.properties.items()}
    print(
        f"\npoison message dead-lettered after {history.get('x-delivery-count')} "
        f"deliveries: reason={history.get('x-dead-letter-reason')}, from "
        f"{history.get('x-original-queue')}/{history.get('x-original-group')} "
        f"partition {history.get('x-original-partition')}"
    )
    stop.set()
    amqp_stop.set()
    await asyncio.gather(*workers, amqp_consumer, return_exceptions=True)
    await _show(gateway, "final state")
    for client in (clients[0], clients[1], admin):
        await client.close()

    problems = verify(tally, per_key)
    if history.get("x-original-queue") != QUEUE:
        problems.append("the dead letter does not name its original queue")
    print(
        f"\npublished {total} messages in {publish_seconds:.1f} s over 4 protocols; "
        f"{tally.redelivered} redelivered after the crash"
    )
    if problems:
        print("verification FAILED:\n  " + "\n  ".join(problems[:20]))
        return 1
    print(
        f"verification: per-key order held for {KEYS} keys, {total}/{total} messages "
        f"processed, nothing lost; poison message in {QUEUE}.dlq"
    )
    return 0
