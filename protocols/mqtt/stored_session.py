"""An MQTT session as the gateway keeps it in SQL, so it survives a restart or failover:
that it exists, when it expires, and the QoS 2 packet ids stored and waiting for PUBREL.

How it works. A QoS 2 message and its packet id are stored in one transaction (the sink's
``publish(..., qos2_packet_id=)``), so a PUBLISH re-sent to another gateway after a
failover is answered, not stored again. A PUBREL is made durable before its PUBCOMP:
``releases`` collects the packet ids released since the last round and one task has the
stored session forget them in one commit, then the connection sends their PUBCOMPs. The
client reuses an id only after its PUBCOMP, so a restored session never holds an id the
client moved on from (its next message would look like a re-send), and a client that
streams QoS 2 pays one commit per round, not per message. When the connection ends the
row is given the session's expiry, or dropped when the session ends with it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from core.errors import KeygateError
from protocols._log import ConnectionLog
from protocols.mqtt.session import Session
from protocols.sink import Sink


class StoredSession:
    def __init__(
        self,
        sink: Sink,
        log: ConnectionLog,
        release_done: Callable[[frozenset[int]], Awaitable[None]],
        release_failed: Callable[[], None],
    ) -> None:
        self._sink = sink
        self._log = log
        self._release_done = release_done
        self._release_failed = release_failed
        self.client_id: str | None = None
        # Whether a row exists (loaded, or written by a QoS 2 publish or a save).
        self.saved = False
        self._pending: set[int] = set()
        self._wake = asyncio.Event()

    async def load(self, client_id: str, *, clean_start: bool) -> set[int] | None:
        """At CONNECT: drop the stored session (clean start) or read its waiting packet
        ids (None: none stored). Raises KeygateError when storage cannot answer."""
        self.client_id = client_id
        if clean_start:
            await self._sink.drop_mqtt_session(client_id)
            return None
        stored = await self._sink.mqtt_session(client_id)
        self.saved = stored is not None
        return stored

    def release(self, packet_id: int) -> None:
        """A PUBREL of a stored QoS 2 message: released in the next round."""
        self._pending.add(packet_id)
        self._wake.set()

    async def run_releases(self) -> None:
        """Release in rounds until cancelled; a failed round ends it (``release_failed``:
        the connection closes without the PUBCOMPs, and the client sends PUBREL again)."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            ids, self._pending = frozenset(self._pending), set()
            if not ids or self.client_id is None:
                continue
            try:
                await self._sink.mqtt_released(self.client_id, ids)
            except KeygateError as e:
                self._log.warning("mqtt %s: cannot store a release: %s", self.client_id, e.message)
                self._release_failed()
                return
            await self._release_done(ids)

    async def ended(self, session: Session) -> None:
        """The connection ended: the row expires with the session, or goes at once."""
        if not self.saved or self.client_id is None:
            return
        try:
            if session.expiry_interval <= 0:
                await self._sink.drop_mqtt_session(self.client_id)
            else:
                await self._sink.save_mqtt_session(
                    self.client_id, expires_in=session.expiry_interval
                )
        except KeygateError as e:
            # What is stored stays stored; only a re-send after a failover may repeat.
            self._log.warning("mqtt %s: cannot store the session: %s", self.client_id, e.message)


__all__ = ["StoredSession"]
