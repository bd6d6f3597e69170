"""Where one message's latency goes, stage by stage, at a fixed offered rate.

    .venv/bin/python -m benchmarks.stages --rate 1000 --seconds 4
    .venv/bin/python -m benchmarks.stages --postgres postgresql://postgres@127.0.0.1:5432/test

A confirmed native publisher (a process of its own) sends 1 KiB messages stamped with
their send time to a gateway in its own process; one client-ack consumer receives them.
The gateway is ``keygate serve`` run by this module, which first wraps a few of the
store's and the native listener's methods to note, per message, the wall-clock time it
reached them: the broker's publish time (the message's own), ``SqlStore.append_each``, its
transaction handed to the writer, the writer thread's first statement, the heads update,
the INSERT, the commit seen by the event loop, the delivery pushed to the consumer's
outbox. The wrappers cost a few microseconds each; the table is for finding where the
time goes, the end-to-end figure for comparing is benchmarks.latency's.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks.native import _publisher, gateway, postgres_target, publisher_process
from gateway.client import Client

# (stage, from stamp, to stamp); "sent" and "received" are the clients'.
STAGES = (
    ("send → broker (read, decode)", "sent", "publish"),
    ("broker → SqlStore.append_each (route, validate, build)", "publish", "append"),
    ("append → the transaction is sent (group commit's turn)", "append", "write"),
    ("sent → writer thread's first statement (hand-over, GIL)", "write", "first"),
    ("first statement → heads update (fence check)", "first", "heads"),
    ("heads update → INSERT", "heads", "insert"),
    ("INSERT → commit seen by the loop (INSERT, COMMIT, hand-back)", "insert", "committed"),
    ("commit → delivery pushed to the outbox", "committed", "pushed"),
    ("outbox → consumer has it", "pushed", "received"),
    ("end to end", "sent", "received"),
)


def _serve(argv: list[str]) -> int:
    """``keygate serve`` with per-message stamps, written to $KEYGATE_STAGES_FILE at exit."""
    import protocols.native.requests as requests
    import storage.base as base
    import storage.store as store
    from gateway.cli import main

    stamps: dict[str, dict[str, float]] = {}
    # The writer thread's current transaction: its first statement and its heads update
    # (the thread runs one transaction at a time; the INSERT takes them over).
    current: dict[str, float] = {}

    def note(message_ids: Any, name: str) -> None:
        now = time.time()
        for message_id in message_ids:
            stamps.setdefault(message_id, {})[name] = now

    def on_writer(owner: Any, method: str, name: str) -> None:
        original = getattr(owner, method)

        def stamped(*args: Any, **kwargs: Any) -> Any:
            current[name] = time.time()
            return original(*args, **kwargs)

        setattr(owner, method, stamped)

    original_append = store.SqlStore.append_each
    original_transact = store.SqlStore._transact_appends
    original_insert = base.StoreBase.insert_messages
    original_committed = base.StoreBase.committed
    original_deliver = requests.Requests.deliver

    def append_each(self: Any, units: Any, **kwargs: Any) -> Any:
        note((m.message_id for unit in units for m in unit), "append")
        return original_append(self, units, **kwargs)

    async def transact(self: Any, calls: Any) -> Any:
        note((m.message_id for call in calls for m in call.messages), "write")
        return await original_transact(self, calls)

    def insert(self: Any, conn: Any, messages: Any, *, copy: bool = False) -> None:
        now = time.time()
        for message in messages:
            stamp = stamps.setdefault(message.message_id, {})
            stamp.update(current, publish=message.publish_time, insert=now)
        original_insert(self, conn, messages, copy=copy)

    def committed(self: Any, allocation: Any, messages: Any) -> None:
        note((m.message_id for m in messages), "committed")
        original_committed(self, allocation, messages)

    def deliver(self: Any, deliveries: Any, **kwargs: Any) -> Any:
        ids = (d.message.message_id for d in deliveries)
        note([i for i in ids if "pushed" not in stamps.get(i, {})], "pushed")
        return original_deliver(self, deliveries, **kwargs)

    store.SqlStore.append_each = append_each  # type: ignore[method-assign]
    store.SqlStore._transact_appends = transact  # type: ignore[method-assign]
    base.StoreBase.insert_messages = insert  # type: ignore[method-assign]
    base.StoreBase.committed = committed  # type: ignore[method-assign]
    requests.Requests.deliver = deliver  # type: ignore[method-assign]
    for method in ("_first_write", "_renew_fence"):
        on_writer(base.StoreBase, method, "first")
    on_writer(base, "_no_check", "first")
    for method in ("advance_heads", "lock_heads"):
        on_writer(base.StoreBase, method, "heads")

    def dump() -> None:
        Path(os.environ["KEYGATE_STAGES_FILE"]).write_text(json.dumps(stamps))

    atexit.register(dump)
    return main(argv)


async def _run(url: str, rate: int, seconds: float) -> dict[str, dict[str, float]]:
    """Publish and consume; the clients' stamps per message id."""
    queue = "stages-" + uuid.uuid4().hex[:8]
    async with Client(url) as admin:
        await admin.declare_queue(queue, partitions=16)
    seen: dict[str, dict[str, float]] = {}
    async with Client(url) as consuming:
        consumer = await consuming.subscribe(queue, group="stages", window=2000)
        publisher = publisher_process(_publisher, url, queue, rate, seconds)
        try:
            for _ in range(int(rate * seconds)):
                message = await consumer.receive(timeout=60)
                sent = float(str(message.properties["sent"]))
                seen[message.message_id] = {"sent": sent, "received": time.time()}
                await consumer.acknowledge(message)
        finally:
            await asyncio.to_thread(publisher.join, 60)
    return seen


def _report(name: str, stamps: dict[str, dict[str, float]]) -> None:
    print(f"{name}: {len(stamps)} messages, milliseconds p50 / p90 / p99")
    for label, start, end in STAGES:
        spans = sorted(s[end] - s[start] for s in stamps.values() if start in s and end in s)
        if not spans:
            print(f"  {label:<64} (not reached)")
            continue
        p50 = statistics.median(spans) * 1000
        p90, p99 = (spans[int(len(spans) * q)] * 1000 for q in (0.9, 0.99))
        print(f"  {label:<64} {p50:6.2f} {p90:6.2f} {p99:6.2f}")


def main() -> None:
    if sys.argv[1:2] == ["serve"]:
        sys.exit(_serve(sys.argv[1:]))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--postgres", help="measure on this PostgreSQL instead of SQLite")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        db = f"sqlite:///{tmp}/stages.db"
        if args.postgres:
            db = stack.enter_context(postgres_target(args.postgres))
        out = Path(tmp) / "stamps.json"
        os.environ["KEYGATE_STAGES_FILE"] = str(out)
        with gateway(db, module="benchmarks.stages") as (url, _pid):
            clients = asyncio.run(_run(url, args.rate, args.seconds))
        server = json.loads(out.read_text())
    stamps = {i: {**server.get(i, {}), **c} for i, c in clients.items()}
    _report(f"{'postgresql' if args.postgres else 'sqlite'} at {args.rate} msg/s", stamps)


if __name__ == "__main__":
    main()
