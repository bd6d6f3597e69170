"""The gateway's work per message over the native protocol, in CPU instructions counted by
valgrind: what ``benchmarks.native`` measures in CPU seconds, in a unit that does not
move with the machine's speed.

    .venv/bin/python -m benchmarks.native_instructions --messages 2000

``keygate serve`` runs on SQLite (``--postgres URL``: on PostgreSQL, in a schema of its
own) in a process of its own under ``valgrind --tool=callgrind``; this process drives it
with the SDK as ``benchmarks.native`` does (1 KiB messages, 1,000 keys, 16 partitions or
``--partitions N``; a publisher with IN_FLIGHT confirmed publishes in flight on one
connection, then a client-ack consumer with a window of 2,000). Only the gateway is
counted: its listener, broker, store and writer thread, not the client nor the kernel.
Once it has started and the queue is declared its counters are zeroed, then dumped after
each of four phases: publish N, publish N more, consume N, consume N more. Printed: the
second publish phase over N, the instructions of one message published and confirmed
(start-up and first-use costs left out), and both consume phases over 2N, of one message
delivered and acked (the first consume phase delivers up to a window more than it acks,
the second as much less). What runs on a timer (housekeeping: ack flushes, retention) is
counted with the phase it fell in, and runs on intervals SLOWDOWN times the defaults:
valgrind slows the gateway about that much, so per message they fire about as often as
at full speed, and how busy the machine was moves the count less (at the default
intervals, two runs of the same code differed by 4 %); the native idle timeout and the
gateway lease's time to live are as long again, so that no connection is closed as
silent and the gateway does not give up its lease while a step lasts a minute under
valgrind on a busy machine.
Only user-space instructions are counted, not the kernel's: a change that trades system
calls for instructions reads worse here than it runs (PostgreSQL appends with COPY: +11 %
instructions, 25 % fewer CPU seconds), so check such a change in CPU seconds too
(``benchmarks.native``).
``--keep DIR`` keeps the callgrind files (one per phase, every function named in full in
each): ``benchmarks.callgrind_top`` reads the functions' own costs from one, or the
growth from another (``callgrind_annotate`` 3.19 puts all of it on ``_PyEval_Vector``).
Python runs about 50 times slower under valgrind: a run takes a few minutes, most of them the
gateway's start.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import re
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any

from benchmarks.native import IN_FLIGHT, gateway, postgres_target, publish_rate
from gateway.client import Client
from gateway.config import GatewayConfig

PARTITIONS = 16
WINDOW = 2000
PHASES = ("publish-1", "publish-2", "consume-1", "consume-2")
SLOWDOWN = 50


def _control(pid: int, command: str) -> None:
    """Tell the callgrind of process ``pid`` to ``--zero`` or ``--dump=NAME`` its counters."""
    subprocess.run(["callgrind_control", command, str(pid)], check=True, capture_output=True)


async def phases(
    url: str, messages: int, control: Callable[[str], None], partitions: int = PARTITIONS
) -> None:
    """Drive the gateway at ``url`` through PHASES of ``messages`` each, on a queue of
    ``partitions``: ``control`` is called with ``--zero`` before them and ``--dump=PHASE``
    after each."""
    queue = "bench-" + uuid.uuid4().hex[:8]
    async with Client(url) as admin:
        await admin.declare_queue(queue, partitions=partitions)
    await asyncio.to_thread(control, "--zero")
    for phase in PHASES[:2]:
        await publish_rate(url, queue, messages)
        await asyncio.to_thread(control, f"--dump={phase}")
    async with Client(url) as client:
        consumer = await client.subscribe(queue, group="bench", window=WINDOW)
        for phase in PHASES[2:]:
            for _ in range(messages):
                await consumer.acknowledge(await consumer.receive(timeout=120))
            await asyncio.to_thread(control, f"--dump={phase}")
        await consumer.close()


def _dumped(out: Path) -> dict[str, int]:
    """Instructions per dump of a callgrind output file family, by trigger name."""
    counts = {}
    for part in out.parent.glob(out.name + ".*"):
        text = part.read_text(errors="replace")
        trigger = re.search(r"^desc: Trigger: dump (\S+)", text, re.MULTILINE)
        summary = re.search(r"^summary: (\d+)", text, re.MULTILINE)
        if trigger and summary:
            counts[trigger.group(1)] = int(summary.group(1))
    return counts


def counted(
    drive: Callable[[str, Callable[[str], None]], Coroutine[Any, Any, None]],
    phases: Sequence[str],
    *,
    keep: Path | None = None,
    postgres: str | None = None,
    mqtt: dict[str, int] | None = None,
) -> dict[str, int]:
    """Run ``drive(url, control)`` against ``keygate serve`` under callgrind (on SQLite,
    or in a schema of its own on PostgreSQL at ``postgres``; its timers, idle timeout and
    lease scaled by SLOWDOWN): ``url`` is its native URL, ``control`` zeroes (``--zero``)
    or dumps (``--dump=PHASE``) its counters. Returns the instructions of each of
    ``phases``; ``keep``: a directory to copy the callgrind files to; ``mqtt``: as for
    ``benchmarks.native.gateway`` (filled before ``drive`` runs)."""
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("valgrind is not installed (Debian package valgrind)")
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        out = tmp / "callgrind.out"
        # Names written in full in every dump, so that each can be read alone
        # (benchmarks.callgrind_top).
        wrapper = [
            "valgrind",
            "--tool=callgrind",
            "--compress-strings=no",
            "--compress-pos=no",
            f"--callgrind-out-file={out}",
        ]
        config = tmp / "keygate.toml"
        defaults = GatewayConfig()
        config.write_text(
            f"ack_flush_interval = {defaults.ack_flush_interval * SLOWDOWN}\n"
            f"retention_interval = {defaults.retention_interval * SLOWDOWN}\n"
            f"native_idle_timeout = {defaults.native_idle_timeout * SLOWDOWN}\n"
            f"lease_ttl = {defaults.lease_ttl * SLOWDOWN}\n"
        )
        with contextlib.ExitStack() as stack:
            db = f"sqlite:///{tmp}/bench.db"
            if postgres:
                db = stack.enter_context(postgres_target(postgres))
            log = stack.enter_context(open(tmp / "gateway.log", "w"))
            url, pid = stack.enter_context(
                gateway(db, log, wrapper=wrapper, patience=600, config=config, mqtt=mqtt)
            )
            asyncio.run(drive(url, functools.partial(_control, pid)))
        counts = _dumped(out)
        if keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
            for part in out.parent.glob(out.name + "*"):
                shutil.copy(part, keep)
        missing = [phase for phase in phases if phase not in counts]
        if missing:
            tail = (tmp / "gateway.log").read_text()[-2000:]
            raise SystemExit(f"no callgrind dump for {missing}; the gateway's log:\n{tail}")
        return counts


def instructions(
    messages: int,
    keep: Path | None = None,
    postgres: str | None = None,
    partitions: int = PARTITIONS,
) -> dict[str, int]:
    """Instructions the gateway spent in each phase of a run of ``messages`` per phase;
    ``keep``: a directory to copy the callgrind files to; ``postgres``: a PostgreSQL URL
    to store in instead of SQLite; ``partitions``: the queue's."""
    return counted(
        lambda url, control: phases(url, messages, control, partitions),
        PHASES,
        keep=keep,
        postgres=postgres,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=2000, help="messages per phase")
    parser.add_argument("--runs", type=int, default=1, help="runs (each printed)")
    parser.add_argument("--keep", type=Path, metavar="DIR", help="keep the callgrind files")
    parser.add_argument("--postgres", metavar="URL", help="store in PostgreSQL, not SQLite")
    parser.add_argument("--partitions", type=int, default=PARTITIONS, help="the queue's")
    args = parser.parse_args()
    for _ in range(args.runs):
        counts = instructions(args.messages, args.keep, args.postgres, args.partitions)
        consumed = (counts["consume-1"] + counts["consume-2"]) / (2 * args.messages)
        print(
            f"native, {'PostgreSQL' if args.postgres else 'SQLite'}, {args.partitions} "
            f"partitions, {IN_FLIGHT} publishes in flight, window {WINDOW}: "
            f"{counts['publish-2'] / args.messages:,.0f} instructions per message published "
            f"(the first {args.messages:,}: {counts['publish-1'] / args.messages:,.0f}), "
            f"{consumed:,.0f} per message delivered and acked",
            flush=True,
        )


if __name__ == "__main__":
    main()
