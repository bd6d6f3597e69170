"""What password guessing may cost: failed logins per peer address and per user name, and
the password hashes computed at once.

How it works. ``Authenticator.authenticate`` (gateway/security.py) checks a password
inside two ``LoginThrottle.checking`` slots, the peer address's and the user name's, and
reports a wrong one to both with ``failed``:

- Per address (5 failures within 60 s, then blocked 1 s, 2 s, 4 s ... 60 s): one host
  guessing any names.
- Per user name (10 failures within 60 s, then the same growing blocks), from any
  address: many addresses guessing one name (QA's flood came from 127.0.0.2, 127.0.0.3,
  ... each under the address budget). A block of the name does not apply to an address
  the user logged in from successfully within ``TRUSTED_TTL`` (``TrustedAddresses``), so
  a flood against a name does not lock its clients out of the places they use: an
  attacker there is still held to the address budget.

``PasswordChecks`` bounds the hashes themselves, whoever asks: at most half the CPUs
hash at once, ``running``, and ``waiting`` more wait for one of them; a check over both is
refused at once with ``AuthenticationFailed`` and counts as nobody's failure. A spray of
guesses over many names from many addresses, each within its budgets, therefore takes no
more than those CPUs: before, every guess got a worker thread, the hashes took every
core and the event loop serving everyone else got a fraction of one (QA: a canary's
logins fell from 70 to 6.7 round trips per second). A login whose password was checked
recently needs no hash (the memo in gateway/security.py) and is not held up by either.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Final

from core.errors import AuthenticationFailed

TRUSTED_TTL: Final = 24 * 3600.0
_TRUSTED_MAX: Final = 16_384
DEFAULT_HASHING: Final = max(1, (os.cpu_count() or 2) // 2)
DEFAULT_HASH_WAITING: Final = 4 * DEFAULT_HASHING


@dataclass
class LoginThrottle:
    """Failed logins per key (a peer address or a user name; ``subject`` names it in the
    refusal): after ``limit`` failures within ``window`` seconds each further failure
    blocks the key for twice as long as the last (1 s, 2 s, 4 s ... up to ``max_delay``);
    a login attempt while blocked is refused unchecked, and so is one that was being
    checked when the key got blocked (guesses sent in parallel).

    Guesses in flight count against the budget before their outcome: ``checking`` lets at
    most ``limit`` checks of one key run at once, less its recent failures (but one
    always, once a block is over), so a burst sent in parallel is throttled exactly like
    the same guesses in a row (all hashed at once, a right password last in the burst
    could finish before the wrong ones had blocked the key)."""

    limit: int = 5
    window: float = 60.0
    max_delay: float = 60.0
    max_keys: int = 10_000
    subject: str = "from {}"
    _failures: dict[str, deque[float]] = field(default_factory=dict)
    _blocked_until: dict[str, float] = field(default_factory=dict)
    _checking: dict[str, int] = field(default_factory=dict)
    _done: asyncio.Condition | None = None

    @contextlib.asynccontextmanager
    async def checking(self, key: str | None, clock: Callable[[], float]) -> AsyncIterator[None]:
        """Hold one of the key's check slots (waiting for one), refusing if it is or gets
        blocked meanwhile."""
        name = key or ""
        if self._done is None:
            self._done = asyncio.Condition()
        async with self._done:
            while True:
                now = clock()
                self.check(key, now)
                recent = sum(t > now - self.window for t in self._failures.get(name, ()))
                if self._checking.get(name, 0) < max(1, self.limit - recent):
                    break
                await self._done.wait()
            self._checking[name] = self._checking.get(name, 0) + 1
        try:
            yield
        finally:
            async with self._done:
                left = self._checking[name] - 1
                if left:
                    self._checking[name] = left
                else:
                    del self._checking[name]
                self._done.notify_all()

    def blocked(self, key: str | None, now: float) -> bool:
        until = self._blocked_until.get(key or "")
        return until is not None and now < until

    def check(self, key: str | None, now: float) -> None:
        if self.blocked(key, now):
            until = self._blocked_until[key or ""]
            raise AuthenticationFailed(
                f"too many failed logins {self.subject.format(key)}; retry in {until - now:.0f}s"
            )

    def failed(self, key: str | None, now: float) -> None:
        name = key or ""
        if name not in self._failures and len(self._failures) >= self.max_keys:
            self._forget_old(now)
        failures = self._failures.setdefault(name, deque())
        failures.append(now)
        while failures and failures[0] <= now - self.window:
            failures.popleft()
        excess = len(failures) - self.limit
        if excess >= 0:
            self._blocked_until[name] = now + min(self.max_delay, 2.0**excess)

    def _forget_old(self, now: float) -> None:
        for key in [k for k, q in self._failures.items() if not q or q[-1] <= now - self.window]:
            del self._failures[key]
            self._blocked_until.pop(key, None)


class TrustedAddresses:
    """(user, peer address) pairs that logged in with the right password within
    ``TRUSTED_TTL``, the most recent ``_TRUSTED_MAX`` of them."""

    def __init__(self) -> None:
        self._until: OrderedDict[tuple[str, str], float] = OrderedDict()

    def trusts(self, user: str, peer: str | None, now: float) -> bool:
        return self._until.get((user, peer or ""), 0.0) > now

    def add(self, user: str, peer: str | None, now: float) -> None:
        key = (user, peer or "")
        self._until[key] = now + TRUSTED_TTL
        self._until.move_to_end(key)
        if len(self._until) > _TRUSTED_MAX:
            self._until.popitem(last=False)


class PasswordChecks:
    """The password hashes being computed (at most ``running``) or waiting for that
    (at most ``waiting``); see the module doc."""

    def __init__(self, running: int = DEFAULT_HASHING, waiting: int = DEFAULT_HASH_WAITING) -> None:
        self.limit = running + waiting
        self.held = 0
        self._running = asyncio.Semaphore(running)

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold a place to hash, waiting for a running one; AuthenticationFailed at once
        when every place is taken."""
        if self.held >= self.limit:
            raise AuthenticationFailed("too many logins being checked at once; retry shortly")
        self.held += 1
        try:
            async with self._running:
                yield
        finally:
            self.held -= 1


__all__ = [
    "DEFAULT_HASHING",
    "DEFAULT_HASH_WAITING",
    "TRUSTED_TTL",
    "LoginThrottle",
    "PasswordChecks",
    "TrustedAddresses",
]
