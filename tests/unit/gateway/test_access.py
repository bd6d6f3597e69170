"""Permission decisions (gateway/access.py): what a user may do, and what asking costs."""

from __future__ import annotations

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
