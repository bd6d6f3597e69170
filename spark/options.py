"""The ``keygate`` data source's options, parsed and validated once on the driver.

Offsets are per-partition seqs, JSON objects keyed by the partition number as a string:
``{"0": 41, "1": 17}``. An offset is the last seq *consumed* (the group's committed seq
has the same meaning), so a read covers seqs ``start < seq <= end``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from core.errors import InvalidArgument
from core.model import validate_name

DEFAULT_LEASE_TIMEOUT: Final = 60.0
_TRUE: Final = frozenset({"true", "1", "yes"})
_FALSE: Final = frozenset({"false", "0", "no"})

Offsets = dict[int, int]


class Start(StrEnum):
    COMMITTED = "committed"
    EARLIEST = "earliest"
    LATEST = "latest"


@dataclass(frozen=True, slots=True)
class SourceOptions:
    url: str
    queue: str
    group: str
    start: Start | Offsets = Start.COMMITTED
    # None = the partitions' heads when the read is planned.
    end: Offsets | None = None
    max_offsets_per_trigger: int | None = None
    min_partitions: int = 1
    include_properties: bool = True
    lease_timeout: float = DEFAULT_LEASE_TIMEOUT
    # Leave out nacked messages not due again at this time (set by consume_batch).
    due_at: float | None = None


def parse_offsets(name: str, text: str) -> Offsets:
    """``{"0": 41}`` -> ``{0: 41}``; InvalidArgument for anything else."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidArgument(f'{name} must be JSON like {{"0": 41}}: {e}') from e
    if not isinstance(raw, dict):
        raise InvalidArgument(f"{name} must be a JSON object of partition -> seq")
    offsets: Offsets = {}
    for partition, seq in raw.items():
        if not (isinstance(partition, str) and partition.isdigit()):
            raise InvalidArgument(f"{name}: partition {partition!r} is not a number")
        if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
            raise InvalidArgument(f"{name}: seq for partition {partition} must be an int >= 0")
        offsets[int(partition)] = seq
    return offsets


def offsets_json(offsets: Mapping[int, int]) -> dict[str, int]:
    """The form Spark checkpoints: string keys, sorted for stable logs."""
    return {str(p): offsets[p] for p in sorted(offsets)}


def _positive(name: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError as e:
        raise InvalidArgument(f"{name} must be a positive integer, got {text!r}") from e
    if value < 1:
        raise InvalidArgument(f"{name} must be a positive integer, got {text!r}")
    return value


def _bool(name: str, text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    raise InvalidArgument(f"{name} must be true or false, got {text!r}")


def _float(name: str, text: str) -> float:
    try:
        return float(text)
    except ValueError as e:
        raise InvalidArgument(f"{name} must be a number, got {text!r}") from e


def parse_options(options: Mapping[str, str]) -> SourceOptions:
    """Validate the user's options (keys are case-insensitive, as Spark's are)."""
    lowered = {key.lower(): value for key, value in options.items()}
    missing = [name for name in ("url", "queue", "group") if not lowered.get(name)]
    if missing:
        raise InvalidArgument(f"keygate source needs option(s) {', '.join(missing)}")
    start_text = lowered.get("startingoffsets", Start.COMMITTED.value).strip()
    start: Start | Offsets
    if start_text.startswith("{"):
        start = parse_offsets("startingOffsets", start_text)
    else:
        try:
            start = Start(start_text.lower())
        except ValueError as e:
            raise InvalidArgument(
                "startingOffsets must be committed, earliest, latest or JSON offsets"
            ) from e
    end_text = lowered.get("endingoffsets", "latest").strip()
    end = None if end_text.lower() == "latest" else parse_offsets("endingOffsets", end_text)
    max_trigger = lowered.get("maxoffsetspertrigger")
    try:
        lease_timeout = float(lowered.get("leasetimeout", DEFAULT_LEASE_TIMEOUT))
    except ValueError as e:
        raise InvalidArgument("leaseTimeout must be a number of seconds") from e
    if lease_timeout <= 0:
        raise InvalidArgument("leaseTimeout must be > 0")
    return SourceOptions(
        url=lowered["url"],
        queue=validate_name("queue", lowered["queue"]),
        group=validate_name("group", lowered["group"]),
        start=start,
        end=end,
        max_offsets_per_trigger=(
            _positive("maxOffsetsPerTrigger", max_trigger) if max_trigger else None
        ),
        min_partitions=_positive("minPartitions", lowered.get("minpartitions", "1")),
        include_properties=_bool("includeProperties", lowered.get("includeproperties", "true")),
        lease_timeout=lease_timeout,
        due_at=_float("dueAt", lowered["dueat"]) if "dueat" in lowered else None,
    )
