"""Finding the rows that make ``fn`` raise: consume_batch's poison isolation.

When ``fn(df)`` raises, the batch is split in halves (consecutive ``(partition, seq)``
ranges, so each part is a cheap filter of the same DataFrame) and ``fn`` runs on each
half; a half that raises is split again, down to single rows. A single row on which
``fn`` raises is *poison*: it alone is counted as failed, with the exception's type as
its dead-letter reason. Every part that ran without raising has succeeded (except the
ids ``fn`` returned for it). If ``fn`` raises on every single row, or the run budget is
spent before the poison is found, the job is broken rather than a row: the original
exception is raised and nothing is settled. One exception: when every row of the batch
is a redelivery (``delivery_count > 1``, it failed before), they are all poison, so a
poison row left alone in the backlog still advances to the dead-letter queue.

The cost: each split re-runs ``fn`` on fewer rows. One poison row in ``n`` rows costs
about ``2 * log2(n)`` extra runs; the budget (``isolation_runs``) bounds them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Final

from pyspark.errors import PythonException
from pyspark.sql import DataFrame

from core.errors import InvalidArgument

DEFAULT_ISOLATION_RUNS: Final = 64
# The Python worker's traceback ends with "SomeError: message".
_WORKER_ERROR: Final = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)):", re.M)

_Row = tuple[int, int, str, int]  # partition, seq, message_id, delivery_count


@dataclass(slots=True)
class Outcome:
    """What fn reported: ids it returned as failed, and poison rows (id -> error name)."""

    failed: set[str] = field(default_factory=set)
    poison: dict[str, str] = field(default_factory=dict)


def failed_ids(outcome: object) -> set[str]:
    """The ids in ``fn``'s return value (None, an iterable of ids, or a DataFrame)."""
    if outcome is None:
        return set()
    if isinstance(outcome, DataFrame):
        return {row["message_id"] for row in outcome.select("message_id").collect()}
    if isinstance(outcome, str) or not isinstance(outcome, Iterable):
        raise InvalidArgument("fn must return None or an iterable of failed message ids")
    return {str(message_id) for message_id in outcome}


def error_name(error: BaseException) -> str:
    """The exception's type; for a failure inside a Spark task, the worker's type."""
    if isinstance(error, PythonException):
        names = _WORKER_ERROR.findall(str(error))
        if names:
            return str(names[-1]).rsplit(".", 1)[-1]
    return type(error).__name__


def _part(df: DataFrame, first: _Row, last: _Row) -> DataFrame:
    p, s = df["partition"], df["seq"]
    after = (p > first[0]) | ((p == first[0]) & (s >= first[1]))
    before = (p < last[0]) | ((p == last[0]) & (s <= last[1]))
    return df.where(after & before)


def run_isolated(df: DataFrame, fn: Callable[[DataFrame], Any], budget: int) -> Outcome:
    """Run ``fn(df)``; if it raises, find the poison rows with at most ``budget`` more
    runs (0 = no isolation: the exception is raised)."""
    try:
        return Outcome(failed_ids(fn(df)))
    except InvalidArgument:
        raise
    except Exception as error:
        if budget < 1:
            raise
        first = error
    rows: list[_Row] = sorted(
        (row.partition, row.seq, row.message_id, row.delivery_count)
        for row in df.select("partition", "seq", "message_id", "delivery_count").collect()
    )
    outcome = Outcome()
    if len(rows) == 1:
        stack = []
        outcome.poison[rows[0][2]] = error_name(first)
    else:
        mid = len(rows) // 2
        stack = [(mid, len(rows)), (0, mid)]
    runs = 0
    while stack:
        lo, hi = stack.pop()
        if runs == budget:
            first.add_note(f"keygate: poison isolation gave up after {runs} runs of fn")
            raise first
        runs += 1
        try:
            outcome.failed |= failed_ids(fn(_part(df, rows[lo], rows[hi - 1])))
        except InvalidArgument:
            raise
        except Exception as error:
            if hi - lo == 1:
                outcome.poison[rows[lo][2]] = error_name(error)
            else:
                mid = (lo + hi) // 2
                stack += [(mid, hi), (lo, mid)]
    if len(outcome.poison) == len(rows) and any(row[3] <= 1 for row in rows):
        raise first  # fn fails on every row: the job is broken, not a row
    return outcome


__all__ = ["DEFAULT_ISOLATION_RUNS", "Outcome", "error_name", "failed_ids", "run_isolated"]
