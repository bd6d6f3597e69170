"""From group state and options to Spark input partitions.

One input partition per queue partition, covering seqs ``lo < seq <= hi``; with
``minPartitions`` the largest ranges are cut into consecutive seq ranges (so a key's rows
may span several Spark partitions, still in publish order by partition index).
``maxOffsetsPerTrigger`` is shared between partitions in proportion to their backlog
(largest remainders first), like Kafka's source: a hot partition does not starve the
others and every partition with a backlog moves as long as the limit allows.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass

from pyspark.sql.datasource import InputPartition

from core.actions import SeqRanges
from spark.db import PartitionState
from spark.options import Offsets, Start


@dataclass(frozen=True)
class ReadRange(InputPartition):
    """One Spark task's work: plain data only, pickled to the executor that reads it."""

    url: str
    queue: str
    group: str
    partition: int
    lo: int
    hi: int
    # Seqs the group acked individually above its committed seq, or (consume_batch) not due
    # yet or expired: skipped.
    skip: SeqRanges
    # Seqs at or below it were delivered before (a delivery count of at least 1).
    dispatched: int
    include_properties: bool
    # The group's tag filter (property name, text): other messages are not shown.
    tags: tuple[tuple[str, str], ...] = ()
    # Streams: messages whose expire_at is at or before this time are left out (and
    # settled by the commit that passes them).
    live_at: float | None = None


def start_offsets(states: Mapping[int, PartitionState], start: Start | Offsets) -> Offsets:
    if start is Start.COMMITTED:
        return {p: s.committed for p, s in states.items()}
    if start is Start.EARLIEST:
        return {p: s.earliest for p, s in states.items()}
    if start is Start.LATEST:
        return {p: s.head for p, s in states.items()}
    return {p: start.get(p, s.committed) for p, s in states.items()}


def end_offsets(states: Mapping[int, PartitionState], end: Offsets | None) -> Offsets:
    """The requested ends, never beyond what is stored."""
    return {p: min(s.head, (end or {}).get(p, s.head)) for p, s in states.items()}


def limit_offsets(start: Mapping[int, int], end: Mapping[int, int], limit: int) -> Offsets:
    """Move at most ``limit`` seqs past ``start`` in total, proportionally to backlog."""
    backlog = {p: max(0, end[p] - start[p]) for p in end}
    total = sum(backlog.values())
    if total <= limit:
        return dict(end)
    shares = {p: limit * b // total for p, b in backlog.items()}
    spare = limit - sum(shares.values())
    by_remainder = sorted(backlog, key=lambda p: (-(limit * backlog[p] % total), -backlog[p], p))
    for p in by_remainder:
        if spare == 0:
            break
        if shares[p] < backlog[p]:
            shares[p] += 1
            spare -= 1
    return {p: start[p] + shares[p] for p in end}


def _split(lo: int, hi: int, pieces: int) -> list[tuple[int, int]]:
    size = hi - lo
    bounds = [lo + size * i // pieces for i in range(pieces + 1)]
    return [(a, b) for a, b in itertools.pairwise(bounds) if b > a]


def read_ranges(
    *,
    url: str,
    queue: str,
    group: str,
    states: Mapping[int, PartitionState],
    start: Mapping[int, int],
    end: Mapping[int, int],
    min_partitions: int,
    include_properties: bool,
    tags: tuple[tuple[str, str], ...] = (),
    live_at: float | None = None,
) -> list[ReadRange]:
    """Input partitions for ``start < seq <= end``, empty ranges left out, in partition
    and seq order."""
    spans = {p: (start[p], end[p]) for p in sorted(end) if end[p] > start.get(p, end[p])}
    total = sum(hi - lo for lo, hi in spans.values())
    ranges: list[ReadRange] = []
    for partition, (lo, hi) in spans.items():
        pieces = 1
        if min_partitions > len(spans) and total:
            pieces = max(1, min(hi - lo, -(-(hi - lo) * min_partitions // total)))
        state = states[partition]
        for a, b in _split(lo, hi, pieces):
            skipped = sorted((*state.acked_above, *state.deferred, *state.expired))
            skip = tuple((x, y) for x, y in skipped if y > a and x <= b)
            ranges.append(
                ReadRange(
                    url=url,
                    queue=queue,
                    group=group,
                    partition=partition,
                    lo=a,
                    hi=b,
                    skip=skip,
                    dispatched=state.dispatched,
                    include_properties=include_properties,
                    tags=tags,
                    live_at=live_at,
                )
            )
    return ranges


__all__ = ["ReadRange", "end_offsets", "limit_offsets", "read_ranges", "start_offsets"]
