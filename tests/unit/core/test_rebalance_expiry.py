"""When the rebalance delay ends with no flow left (DESIGN.md §2 partition states, §4
Rebalance): the reserved partitions become ``unassigned`` with no owner, and the group is
idle only then — its owner must keep it running (and ticking) until the reservation ends,
or the partitions stay ``unbound`` for a flow that is gone."""

from __future__ import annotations

from core.model import GroupConfig, PartitionState, QueueConfig
from tests.unit.core.driver import Driver

DELAY = 5.0
NOBODY = (PartitionState.UNASSIGNED, None)


def make(partitions: int = 4) -> Driver:
    queue = QueueConfig("q", partitions=partitions, rebalance_delay=DELAY)
    return Driver(queue, GroupConfig("q", "g"))


def states(d: Driver) -> dict[int, tuple[PartitionState, str | None]]:
    """Per partition: (state, shown owner) as written through and as the status shows."""
    shown = {p.partition: (p.state, p.flow_id) for p in d.machine.status().partitions}
    assert shown == d.assignment, "status and write-through disagree"
    return shown


def test_the_last_flow_leaving_keeps_the_group_busy_until_its_partitions_are_unassigned() -> None:
    d = make()
    d.bind("a")
    d.call(d.machine.unbind, "a")
    assert set(states(d).values()) == {(PartitionState.UNBOUND, "a")}
    assert not d.machine.idle()
    assert d.machine.next_deadline() == DELAY
    d.advance(DELAY)
    assert set(states(d).values()) == {NOBODY}
    assert d.machine.status().flows == ()
    assert d.machine.idle()
    assert d.machine.next_deadline() is None


def test_a_standby_that_binds_and_leaves_during_the_delay_changes_nothing() -> None:
    d = make(partitions=2)
    d.bind("a")
    d.call(d.machine.unbind, "a")
    d.advance(0.3)
    d.bind("s")
    assert d.machine.partitions_of("s") == frozenset()  # all of them reserved for a
    d.call(d.machine.unbind, "s")
    assert set(states(d).values()) == {(PartitionState.UNBOUND, "a")}
    assert not d.machine.idle()
    d.advance(DELAY)
    assert set(states(d).values()) == {NOBODY}
    assert d.machine.idle()


def test_a_standby_that_shuts_down_during_the_delay_changes_nothing() -> None:
    d = make(partitions=2)
    d.bind("a")
    d.call(d.machine.unbind, "a")
    d.bind("s")
    d.call(d.machine.unbind, "s", shutdown=True)
    assert not d.machine.idle()
    d.advance(DELAY)
    assert set(states(d).values()) == {NOBODY}
    assert d.machine.idle()


def test_a_flow_that_took_over_at_expiry_and_left_leaves_its_own_reservation() -> None:
    d = make(partitions=2)
    d.bind("a")
    d.call(d.machine.unbind, "a")
    d.bind("c")
    d.advance(DELAY)
    assert d.machine.partitions_of("c") == frozenset({0, 1})
    d.call(d.machine.unbind, "c")
    assert set(states(d).values()) == {(PartitionState.UNBOUND, "c")}
    assert not d.machine.idle()
    d.advance(DELAY)
    assert set(states(d).values()) == {NOBODY}
    assert d.machine.idle()


def test_the_last_flow_shutting_down_leaves_its_partitions_unassigned_at_once() -> None:
    d = make()
    d.bind("a")
    d.publish("k", partition=0)
    d.call(d.machine.unbind, "a", shutdown=True)
    assert set(states(d).values()) == {NOBODY}
    assert d.machine.idle()
    assert d.machine.next_deadline() is None


def test_a_group_with_a_flow_bound_is_not_idle() -> None:
    d = make()
    assert d.machine.idle()
    d.bind("a")
    assert not d.machine.idle()
