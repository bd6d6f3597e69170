"""Permission decisions (gateway/access.py): what a user may do, and what asking costs."""

from __future__ import annotations

import tracemalloc

import pytest

from core.errors import PermissionDenied
from gateway.access import Access
from gateway.config import GatewayConfig, Permission
from protocols.sink import Principal
from tests.support.security import hashed_users

PERMISSIONS = {
    "admin": Permission(admin=True),
    "watcher": Permission(monitor=("*",)),
    "consumer": Permission(consume=("*",)),
    "publisher": Permission(publish=("*",)),
    "one_char": Permission(monitor=("?",)),
    "bracketed": Permission(monitor=("[*]",)),
    "orders": Permission(publish=("orders*",), consume=("orders",), monitor=("audit-?",)),
}


def _access() -> Access:
    users = hashed_users(**{name: "pw" for name in PERMISSIONS})
    return Access(GatewayConfig(users=users, permissions=PERMISSIONS))


def _user(name: str) -> Principal:
    return Principal(name, "native")


@pytest.mark.parametrize("user", ["admin", "watcher", "consumer"])
def test_metrics_are_for_users_who_may_monitor_every_queue(user: str) -> None:
    _access().check_monitor_all(_user(user))


@pytest.mark.parametrize("user", ["one_char", "bracketed", "publisher", "orders", "nobody"])
def test_metrics_are_refused_to_patterns_that_merely_match_the_name_star(user: str) -> None:
    """``?`` and ``[*]`` match the queue name "*", which the check used to ask about:
    either granted every queue's metrics."""
    with pytest.raises(PermissionDenied):
        _access().check_monitor_all(_user(user))


def test_permission_decisions_are_the_configured_patterns_whatever_the_cache_holds() -> None:
    access = _access()
    queues = ["orders", "orders-eu", "audit-1", "audit-12", "*", "x", "billing"]
    asked = [
        (user, action, queue)
        for user in [*PERMISSIONS, "nobody"]
        for action in ("publish", "consume", "monitor")
        for queue in queues
    ]
    expected = {
        (user, action, queue): PERMISSIONS.get(user, Permission()).allows(action, queue)
        for user, action, queue in asked
    }
    assert any(expected.values()) and not all(expected.values())
    for _ in range(2):  # answered, then answered from the cache
        for user, action, queue in asked:
            assert access.allows(_user(user), action, queue) == expected[user, action, queue]
    for n in range(2 * Access.CACHED_DECISIONS):  # evicts every entry above
        access.allows(_user("publisher"), "consume", f"made-up-{n}")
    for user, action, queue in asked:
        assert access.allows(_user(user), action, queue) == expected[user, action, queue]


def test_denied_publishes_to_made_up_queue_names_do_not_grow_the_cache() -> None:
    """The cache kept one entry per (user, action, queue) ever asked, names of queues that
    do not exist included: 200,000 refused publishes grew a gateway by 70 MiB (QA)."""
    access = _access()
    eve = _user("orders")
    tracemalloc.start()
    try:
        for n in range(100_000):
            assert not access.allows(eve, "publish", f"{'q' * 150}{n}")
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Unbounded: 32 MB. Bounded: about 400 bytes per decision the cache may hold.
    assert held < Access.CACHED_DECISIONS * 1000
