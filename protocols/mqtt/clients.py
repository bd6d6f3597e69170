"""The clients of one MQTT listener: who they are (``authenticate``), which connection
holds each client id and its session (``Clients.open``), and the Wills of connections
that ended.

How it works. A client id has at most one connection. A CONNECT for an id another
connection holds ends that connection first (DISCONNECT 0x8E, ``take_over``), and only
the user who owns the id — through its live connection, or its session while that
lasts — may take it (``may_use``). The session is then read from SQL (or dropped, on
clean start) and joined with the one kept in memory. When a connection ends other than by a normal
DISCONNECT its Will is published after the Will Delay Interval (``schedule_will``); the
same client id connecting again within that delay cancels it (§3.1.3.2.2). Will tasks
belong to the registry's ``Tasks`` and are cancelled when the listener closes.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from core.errors import AuthError, KeygateError, PermissionDenied
from core.model import Publication
from protocols._log import ConnectionLog
from protocols._tasks import Tasks
from protocols.mqtt.connection import ConnectRequest, ServerConnection
from protocols.mqtt.events import ReasonCode
from protocols.mqtt.pipeline import MqttStats
from protocols.mqtt.session import Session, SessionStore
from protocols.mqtt.stored_session import StoredSession
from protocols.sink import Principal, Sink, peer_identity

log = logging.getLogger(__name__)


async def authenticate(
    sink: Sink,
    request: ConnectRequest,
    writer: asyncio.StreamWriter,
    log: ConnectionLog,
) -> Principal | ReasonCode:
    """The user a CONNECT logs in as, or the CONNACK reason code refusing it."""
    connect = request.connect
    password = None
    if connect.password is not None:
        try:
            password = connect.password.decode("utf-8")
        except UnicodeDecodeError:
            return ReasonCode.BAD_USER_NAME_OR_PASSWORD
    try:
        peer, certificate_user = peer_identity(writer)
        return await sink.authenticate(
            connect.username,
            password,
            protocol="mqtt",
            client_id=request.client_id,
            peer=peer,
            certificate_user=certificate_user,
        )
    except PermissionDenied:
        return ReasonCode.NOT_AUTHORIZED
    except AuthError as e:
        log.info("mqtt %s: authentication refused: %s", request.client_id, e.message)
        return ReasonCode.BAD_USER_NAME_OR_PASSWORD
    except KeygateError as e:
        log.warning("mqtt %s: cannot authenticate: %s", request.client_id, e.message)
        return ReasonCode.SERVER_UNAVAILABLE


class Holder(Protocol):
    """A connection as the registry sees it."""

    @property
    def principal(self) -> Principal | None: ...

    async def shutdown(self, reason: ReasonCode) -> None:
        """Close from the server side and wait until the connection has fully ended."""
        ...


class Clients:
    """The client ids of one listener: who holds each, and the Wills still due."""

    def __init__(self, sink: Sink, sessions: SessionStore, stats: MqttStats) -> None:
        self._sink = sink
        self._sessions = sessions
        self._stats = stats
        self._tasks = Tasks("mqtt listener")
        self._active: dict[str, Holder] = {}
        self._wills: dict[str, asyncio.Task[None]] = {}

    async def open(
        self,
        request: ConnectRequest,
        owner: str | None,
        holder: Holder,
        stored: StoredSession,
        log: ConnectionLog,
    ) -> tuple[Session, bool] | ReasonCode:
        """Give ``request.client_id`` to ``holder`` (a connection of user ``owner``) and
        open its session: (session, session present), or the CONNACK reason refusing it."""
        client_id, clean_start = request.client_id, request.connect.clean_start
        loop = asyncio.get_running_loop()
        if not self.may_use(client_id, owner, loop.time()):
            log.info("mqtt %s: client id belongs to another user; refused", client_id)
            return ReasonCode.CLIENT_IDENTIFIER_NOT_VALID
        await self.take_over(client_id, holder)
        try:
            kept = await stored.load(client_id, clean_start=clean_start)
        except KeygateError as e:
            log.warning("mqtt %s: cannot load the session: %s", client_id, e.message)
            return ReasonCode.SERVER_UNAVAILABLE
        session, present = self._sessions.open(client_id, clean_start, loop.time(), owner=owner)
        if kept is not None and not present:
            # Kept in SQL by an earlier run or another gateway (restart, failover).
            session.qos2_received |= kept
            present = True
        return session, present

    def may_use(self, client_id: str, username: str | None, now: float) -> bool:
        """A client id (its connection, its session) is taken over only by its own user."""
        active = self._active.get(client_id)
        if (
            active is not None
            and active.principal is not None
            and active.principal.username != username
        ):
            return False
        return self._sessions.owner(client_id, now) in (None, username)

    async def take_over(self, client_id: str, holder: Holder) -> None:
        """End any other connection of ``client_id`` (0x8E), then make ``holder`` its owner."""
        while (old := self._active.get(client_id)) is not None and old is not holder:
            await old.shutdown(ReasonCode.SESSION_TAKEN_OVER)
            if self._active.get(client_id) is old:
                del self._active[client_id]
        self._active[client_id] = holder
        pending = self._wills.pop(client_id, None)
        if pending is not None:
            pending.cancel()  # reconnected within the Will Delay Interval

    async def ended(
        self, holder: Holder, conn: ServerConnection, stored: StoredSession, *, will_due: bool
    ) -> None:
        """``holder``'s connection ended: its session is stored with its expiry and its
        client id let go; its Will is scheduled unless ``will_due`` is false (a normal
        DISCONNECT already dropped it; a listener shutdown publishes none)."""
        session = conn.session
        if session is not None:
            await stored.ended(session)
            self.release(conn.client_id, holder)
            self._sessions.release(session, asyncio.get_running_loop().time())
        if conn.will is None or holder.principal is None or not will_due:
            return
        delay = min(conn.will_delay, session.expiry_interval if session else 0.0)
        self.schedule_will(conn.client_id or "", holder.principal, conn.will, delay)

    def release(self, client_id: str | None, holder: Holder) -> None:
        if client_id is not None and self._active.get(client_id) is holder:
            del self._active[client_id]

    def schedule_will(
        self, client_id: str, principal: Principal, will: Publication, delay: float
    ) -> None:
        if self._tasks.closed:
            return  # the listener is closing: Wills are not published on shutdown
        task = self._tasks.spawn(
            self._publish_will(client_id, principal, will, delay), name=f"mqtt will {client_id}"
        )
        if delay > 0:
            self._wills[client_id] = task

    async def close(self) -> None:
        """Cancel the Wills still waiting for their delay."""
        await self._tasks.close()

    async def _publish_will(
        self, client_id: str, principal: Principal, will: Publication, delay: float
    ) -> None:
        if delay > 0:
            await asyncio.sleep(delay)  # the Will Delay Interval; cancelled on reconnect
            if self._wills.get(client_id) is asyncio.current_task():
                del self._wills[client_id]
        try:
            await self._sink.publish(principal, will)
            self._stats.wills += 1
        except KeygateError as e:
            log.warning(
                "mqtt %s: will message to %r not stored: %s",
                client_id,
                will.topic,
                e.message,
                extra={"protocol": "mqtt", "client": client_id, "user": principal.username},
            )


__all__ = ["Clients", "Holder"]
