"""A server's CPU time, read from /proc: what the protocol benchmarks report per 100k
messages for keygate and for its peer in the same run."""

from __future__ import annotations

import os
from collections.abc import Awaitable
from pathlib import Path
from typing import Final, TypeVar

CLOCK_TICKS: Final = os.sysconf("SC_CLK_TCK")

T = TypeVar("T")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds the process has used so far."""
    return stat_seconds(Path(f"/proc/{pid}/stat"))


def stat_seconds(stat: Path) -> float:
    """User + system CPU seconds in a /proc stat file: a process's, or one of its threads'
    (/proc/<pid>/task/<tid>/stat)."""
    # The command may contain spaces, so split after its closing ')'.
    fields = stat.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def find_pid(command: str) -> int | None:
    """The first process whose command name is ``command`` (e.g. beam.smp, mosquitto)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() == command:
                    return int(entry.name)
            except OSError:
                continue
    return None


async def cpu_per_100k(pid: int | None, messages: int, run: Awaitable[T]) -> tuple[T, float | None]:
    """Await ``run``; also return the CPU seconds ``pid`` spent meanwhile, per 100k
    messages (None without a pid)."""
    before = cpu_seconds(pid) if pid else None
    result = await run
    if pid is None or before is None:
        return result, None
    return result, (cpu_seconds(pid) - before) * 100_000 / messages


def cpu_text(seconds: float | None) -> str:
    return "" if seconds is None else f"  server CPU {seconds:.1f} s / 100k"
