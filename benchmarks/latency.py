"""End-to-end latency, keygate beside RabbitMQ in the same run: a confirmed publisher at a
fixed offered rate and a client-ack consumer; latency = publish call to receipt by the
consumer, 1 KiB messages, 1,000 keys.

    .venv/bin/python -m benchmarks.latency --rates 1000,5000 --seconds 5
    .venv/bin/python -m benchmarks.latency --postgres postgresql://postgres@127.0.0.1:5432/test
    .venv/bin/python -m benchmarks.latency --rates 1000 --seconds 10 --timeline --rabbitmq off

keygate runs in its own process (``keygate serve``, native protocol, SQLite with fsync and,
with ``--postgres``, PostgreSQL); RabbitMQ is the one on amqp://guest:guest@127.0.0.1:5672
(durable quorum and classic queues, persistent messages, publisher confirms, aio-pika).
For both, the publisher runs in a process of its own and the consumer in this one.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable

import aio_pika

from benchmarks.native import (
    KEYS,
    PAYLOAD,
    gateway,
    latency,
    paced,
    percentiles,
    postgres_target,
    publisher_process,
)
from gateway.client import Client

Measure = Callable[[int, float], Awaitable[tuple[float, float]]]


async def keygate_latency(
    url: str, rate: int, seconds: float, timeline: list[tuple[float, float]] | None = None
) -> tuple[float, float]:
    queue = "lat-" + uuid.uuid4().hex[:8]
    async with Client(url) as admin:
        await admin.declare_queue(queue, partitions=16)
    return await latency(url, queue, rate, seconds, timeline)


def print_timeline(timeline: list[tuple[float, float]], bucket: float = 0.25) -> None:
    """The worst latency of each ``bucket`` seconds of send time, in ms: a stall that
    comes back periodically (a housekeeping job) shows as a column of its own."""
    start = min(sent for sent, _ in timeline)
    worst: dict[int, float] = {}
    for sent, took in timeline:
        index = int((sent - start) / bucket)
        worst[index] = max(worst.get(index, 0.0), took * 1000)
    cells = (f"{index * bucket:.2f}s {worst[index]:.0f}" for index in sorted(worst))
    print(f"    worst per {bucket:.2f} s of send time (ms): {', '.join(cells)}", flush=True)


async def rabbitmq_publish_at(url: str, name: str, rate: int, seconds: float) -> None:
    """Publish persistent messages with confirms at a fixed offered rate, each stamped
    with its send time."""
    connection = await aio_pika.connect(url)
    async with connection:
        publishing = await connection.channel(publisher_confirms=True)
        pending: set[asyncio.Task[object]] = set()  # done ones leave, as in publish_at
        async for i in paced(rate, seconds):
            message = aio_pika.Message(
                PAYLOAD,
                headers={"sent": repr(time.time()), "JMSXGroupID": f"key-{i % KEYS}"},
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            )
            task = asyncio.create_task(
                publishing.default_exchange.publish(message, routing_key=name)
            )
            pending.add(task)
            task.add_done_callback(pending.discard)
        await asyncio.gather(*pending)


def _rabbitmq_publisher(url: str, name: str, rate: int, seconds: float) -> None:
    asyncio.run(rabbitmq_publish_at(url, name, rate, seconds))


async def rabbitmq_latency(
    url: str, queue_type: str, rate: int, seconds: float
) -> tuple[float, float]:
    total = int(rate * seconds)
    samples: list[float] = []
    connection = await aio_pika.connect(url)
    async with connection:
        consuming = await connection.channel()
        await consuming.set_qos(prefetch_count=2000)
        name = f"lat-{queue_type}-{uuid.uuid4().hex[:8]}"
        queue = await consuming.declare_queue(
            name, durable=True, arguments={"x-queue-type": queue_type}
        )
        done = asyncio.get_running_loop().create_future()

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            samples.append(time.time() - float(message.headers["sent"]))  # type: ignore[arg-type]
            await message.ack()
            if len(samples) == total and not done.done():
                done.set_result(None)

        tag = await queue.consume(on_message)
        publisher = publisher_process(_rabbitmq_publisher, url, name, rate, seconds)
        try:
            await asyncio.wait_for(done, 60 + seconds)
        finally:
            await asyncio.to_thread(publisher.join, 60)
        await queue.cancel(tag)
        await queue.delete(if_unused=False, if_empty=False)
    return percentiles(samples)


def report(name: str, rate: int, result: tuple[float, float]) -> None:
    p50, p99 = result
    print(f"{name:>22} at {rate:>5} msg/s: p50 {p50:6.2f} ms  p99 {p99:7.2f} ms", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rates", default="1000,5000", help="offered rates, comma-separated")
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each run")
    parser.add_argument("--postgres", help="also measure keygate on this PostgreSQL")
    parser.add_argument(
        "--rabbitmq", default="amqp://guest:guest@127.0.0.1:5672/", help="URL, or off"
    )
    parser.add_argument(
        "--timeline", action="store_true", help="keygate: the worst latency per 0.25 s"
    )
    args = parser.parse_args()
    rates = [int(r) for r in args.rates.split(",")]
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        targets = {"keygate sqlite": f"sqlite:///{tmp}/latency.db"}
        if args.postgres:
            targets["keygate postgresql"] = stack.enter_context(postgres_target(args.postgres))
        for name, db in targets.items():
            with gateway(db) as (url, _):
                for rate in rates:
                    timeline: list[tuple[float, float]] = []
                    result = asyncio.run(keygate_latency(url, rate, args.seconds, timeline))
                    report(name, rate, result)
                    if args.timeline:
                        print_timeline(timeline)
    for queue_type in ("quorum", "classic") if args.rabbitmq != "off" else ():
        for rate in rates:
            result = asyncio.run(rabbitmq_latency(args.rabbitmq, queue_type, rate, args.seconds))
            report(f"rabbitmq {queue_type}", rate, result)


if __name__ == "__main__":
    main()
