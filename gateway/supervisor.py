"""The active gateway's critical background tasks, watched.

The lease keeper, the store's append and dispatch writers and housekeeping run for as long
as the gateway does; each one's loop handles the failures it expects. One that ends anyway
(an error nobody expected, a return, a cancellation by anything but the gateway's own
stop) leaves the gateway answering "active" without doing its job: a lease nobody renews
(another gateway takes it over while this one still accepts clients), publishes nobody
writes. The supervisor turns that into a stop: ``on_failure`` is called with a sentence
naming the task and how it ended, and the gateway stops at once, exit status 1.

Housekeeping's retention runs are tasks of their own, one per ``retention_interval``, that
end when the run is done: watched ``runs_out``, such a task is reported only when it fails
(an error nobody expected) or is cancelled by anything but the stop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

__all__ = ["Supervisor"]


class Supervisor:
    def __init__(self, on_failure: Callable[[str], None]) -> None:
        self._on_failure = on_failure
        self._standing_down = False

    def watch(self, name: str, task: asyncio.Task[Any], *, runs_out: bool = False) -> None:
        """Report ``task`` (called ``name`` in the report) if it ends before
        ``stand_down``; ``runs_out``: only if it fails or is cancelled (a task that does
        one run of periodic work, and returns when done)."""

        def ended(done: asyncio.Task[Any]) -> None:
            if self._standing_down:
                return
            if done.cancelled():
                how = "cancelled"
            elif (error := done.exception()) is not None:
                how = f"{type(error).__name__}: {error}"
            elif runs_out:
                return
            else:
                how = "returned"
            self._on_failure(f"{name} ended unexpectedly ({how})")

        task.add_done_callback(ended)

    def stand_down(self) -> None:
        """The gateway is stopping: its tasks end now as they should."""
        self._standing_down = True
