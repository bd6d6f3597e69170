"""Who may do what: authentication and the permission checks every interface asks.

``Access`` holds the gateway's ``Authenticator`` (passwords, certificates, throttling;
gateway/security.py) and answers permission questions from the configuration —
deny by default (docs/operations.md, "Security"). Answers are cached per (user, action,
queue), the configuration being fixed for the life of the process, in a least-recently
used cache of ``CACHED_DECISIONS`` entries: the names asked about come from clients, and
a cache of every name ever asked (refused publishes to made-up queues included) grew
without bound.
"""

from __future__ import annotations

import functools
from typing import Final

from core.errors import PermissionDenied
from gateway.config import GatewayConfig
from gateway.security import Authenticator
from protocols.sink import Principal


class Access:
    CACHED_DECISIONS: Final = 8192

    def __init__(self, config: GatewayConfig) -> None:
        self._config = config
        self._decide = functools.lru_cache(maxsize=self.CACHED_DECISIONS)(self._decision)
        self.auth = Authenticator(
            config.users,
            certificate_users=config.certificate_users,
            allow_anonymous=config.allow_anonymous,
        )

    def allows(self, principal: Principal, action: str, queue: str) -> bool:
        return self._decide(principal.username, action, queue)

    def _decision(self, username: str | None, action: str, queue: str) -> bool:
        return self._config.permission(username).allows(action, queue)

    def authorize(self, principal: Principal, action: str, queue: str) -> None:
        """Raise PermissionDenied unless ``principal`` may ``action`` on ``queue``."""
        if not self.allows(principal, action, queue):
            raise PermissionDenied(f"{principal.username!r} may not {action} on queue {queue!r}")

    def may_administer(self, principal: Principal) -> bool:
        return self._config.permission(principal.username).admin

    def check_admin(self, principal: Principal) -> None:
        """Creating, changing and deleting queues, groups, subscriptions and AMQP exchanges
        needs the ``admin`` permission (deny by default: only users granted it)."""
        if not self.may_administer(principal):
            raise PermissionDenied(f"{principal.username!r} may not administer queues")

    def may_monitor(self, principal: Principal, queue: str) -> bool:
        return self.allows(principal, "monitor", queue)

    def check_monitor(self, principal: Principal, queue: str) -> None:
        """Inspecting a queue (depth, groups, owners, passive declare) needs ``monitor``,
        ``consume`` or ``admin``."""
        self.authorize(principal, "monitor", queue)

    def check_monitor_all(self, principal: Principal) -> None:
        """The gateway-wide metrics name every queue: they need ``admin``, or ``monitor``
        or ``consume`` on the pattern ``*``."""
        if not self._config.permission(principal.username).monitors_every_queue():
            raise PermissionDenied(
                f"{principal.username!r} may not read metrics: they need admin, or monitor "
                "or consume on '*'"
            )


__all__ = ["Access"]
