"""Balanced, sticky, deterministic partition assignment (DESIGN.md §4).

How it works: the first ``min(F, N)`` flows in bind order are active, the rest standby.
Each active flow's quota is ``N // F`` or one more; the ``N % F`` larger quotas go to the
flows that currently hold the most partitions (ties: bind order), which minimises the
number of partitions that must leave a flow. Each flow keeps its lowest-numbered current
partitions up to its quota; every other partition (over quota, unowned, or owned by a
flow that is gone or standby) goes, in partition order, to the flows below quota in bind
order. The result only depends on the inputs, and the partitions moved away from an
active flow are exactly ``sum(max(0, held - quota))``, the lower bound.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from core.errors import InvalidArgument


def quotas(
    partitions: int, flows: Sequence[str], current: Mapping[int, str | None]
) -> dict[str, int]:
    """The number of partitions each active flow gets (standby flows are absent)."""
    active = list(flows[:partitions])
    if not active:
        return {}
    base, extra = divmod(partitions, len(active))
    held = dict.fromkeys(active, 0)
    for partition in range(partitions):
        owner = current.get(partition)
        if owner in held:
            held[owner] += 1
    order = sorted(range(len(active)), key=lambda i: (-held[active[i]], i))
    bigger = {active[i] for i in order[:extra]}
    return {flow: base + (1 if flow in bigger else 0) for flow in active}


def assign(
    partitions: int, flows: Sequence[str], current: Mapping[int, str | None]
) -> dict[int, str | None]:
    """Map every partition ``0..partitions-1`` to an active flow (None when no flow).

    ``flows`` are in bind order and must be distinct; ``current`` is the present owner of
    each partition (missing = unowned).
    """
    if partitions < 0:
        raise InvalidArgument(f"partitions must be >= 0, got {partitions}")
    if len(set(flows)) != len(flows):
        raise InvalidArgument("flows must be distinct")
    quota = quotas(partitions, flows, current)
    result: dict[int, str | None] = dict.fromkeys(range(partitions))
    taken = dict.fromkeys(quota, 0)
    loose: list[int] = []
    for partition in range(partitions):
        owner = current.get(partition)
        if owner is not None and owner in quota and taken[owner] < quota[owner]:
            result[partition] = owner
            taken[owner] += 1
        else:
            loose.append(partition)
    needy = iter([flow for flow in quota for _ in range(quota[flow] - taken[flow])])
    for partition in loose:
        result[partition] = next(needy, None)
    return result
