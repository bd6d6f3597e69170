"""Key-granular handoff: how soon a consumer that joins under load gets its first message
of the partition it takes over, while the old owner still holds one busy key of it.

    .venv/bin/python -m benchmarks.handoff --runs 5 --hold 2.0 --rate 500

Consumer A owns both partitions of a queue and acks at once, except one message of a
"busy" key per partition, which it holds. A producer publishes to 100 keys (and the busy
keys) at ``--rate``. Consumer B joins; B's partition P is handed off. Measured from B's
join: ``first`` = B receives its first message of P (another key of P: key-granular
handoff lets it flow at once); ``busy`` = B receives the busy key's next message, which
waits until A acks what it holds, ``--hold`` seconds after the join. A handoff that
paused the whole partition until A's acks (as Solace does, up to max-handoff-time) would
deliver nothing of P before ``busy``. Gateway in its own process, SQLite (and PostgreSQL
with ``--postgres``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import tempfile
import time
import uuid

from benchmarks.native import gateway, postgres_target
from gateway.client import Client, Consumer, Message

KEYS = [f"k{n}" for n in range(100)]
BUSY = [f"busy{n}" for n in range(8)]


async def _produce(url: str, queue: str, rate: int, stop: asyncio.Event) -> None:
    async with Client(url) as producer:
        n = 0
        while not stop.is_set():
            started = time.perf_counter()
            for key in (*KEYS, *BUSY):
                await producer.publish(queue, str(n).encode(), key=key)
                n += 1
            per_round = (len(KEYS) + len(BUSY)) / rate
            await asyncio.sleep(max(0.0, per_round - (time.perf_counter() - started)))


async def _old_owner(
    a: Consumer, held: dict[int, Message], holding: asyncio.Event, release: asyncio.Event
) -> None:
    """Ack everything at once except the first busy message of each partition."""
    while True:
        message = await a.receive()
        if message.key in BUSY and message.partition not in held and not release.is_set():
            held[message.partition] = message
            if len(held) == 2:
                holding.set()
        else:
            await a.acknowledge(message)
        if release.is_set():
            for kept in held.values():
                await a.acknowledge(kept)
            held.clear()


async def one_run(url: str, rate: int, hold: float) -> tuple[float, float]:
    queue = "handoff-" + uuid.uuid4().hex[:8]
    async with Client(url) as admin:
        await admin.declare_queue(queue, partitions=2, max_handoff_time=60.0)
    stop, holding, release, assigned = (asyncio.Event() for _ in range(4))
    held: dict[int, Message] = {}
    async with Client(url, client_name="a") as a_client, Client(url, client_name="b") as b_client:
        a = await a_client.subscribe(queue, group="g", window=1000)
        producing = asyncio.create_task(_produce(url, queue, rate, stop))
        owning = asyncio.create_task(_old_owner(a, held, holding, release))
        await holding.wait()
        joined = time.perf_counter()
        b = await b_client.subscribe(
            queue, group="g", window=1000, on_partitions_changed=lambda _: assigned.set()
        )
        asyncio.get_running_loop().call_later(hold, release.set)
        if not b.partitions:
            await assigned.wait()
        (moving,) = b.partitions
        busy_key = held[moving].key
        first = busy = None
        while busy is None:
            message = await b.receive(timeout=hold + 30)
            await b.acknowledge(message)
            if message.partition != moving:
                continue
            now = time.perf_counter() - joined
            if first is None:
                first = now
            if message.key == busy_key:
                busy = now
        stop.set()
        owning.cancel()
        await producing
    assert first is not None and busy is not None
    return first, busy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--hold", type=float, default=2.0, help="A holds its busy key (s)")
    parser.add_argument("--rate", type=int, default=500, help="offered publish rate (msg/s)")
    parser.add_argument("--postgres", default=os.environ.get("KEYGATE_TEST_POSTGRES_URL"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        targets = {"sqlite": f"sqlite:///{tmp}/bench.db"}
        if args.postgres:
            targets["postgresql"] = stack.enter_context(postgres_target(args.postgres))
        for name, db in targets.items():
            with gateway(db) as (url, _):
                runs = [asyncio.run(one_run(url, args.rate, args.hold)) for _ in range(args.runs)]
            first = statistics.median(r[0] for r in runs) * 1000
            busy = statistics.median(r[1] for r in runs) * 1000
            print(
                f"{name:10s} B's first message of the moving partition {first:7.1f} ms | "
                f"the busy key's next message {busy:7.1f} ms (A acks after {args.hold:.1f} s) "
                f"| median of {args.runs} runs at {args.rate} msg/s"
            )


if __name__ == "__main__":
    main()
