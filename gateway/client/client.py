"""The asyncio SDK entry point: ``Client`` (producer, admin, consumer factory).

Every call is a coroutine that waits for the gateway's answer. Publishes are pipelined:
any number may be in flight on the one connection, each awaiting its own PUBLISH_OK, which
the gateway sends only after the message is committed. While the client is reconnecting,
new calls wait for the new connection. A publish that was in flight when the connection
dropped raises ``ConnectionLost`` (it may or may not be stored) — unless it has a
``dedup_id``, in which case it is resent on the new connection and the gateway's dedup
window drops the copy (on a queue that enables dedup). ``close()`` is graceful: the
publishes in flight get their confirms first (docs/native-protocol.md, CLOSE).

Liveness. The connection pings every ``heartbeat`` seconds (2 by default; 0 = never)
and is cut and reconnected when three intervals in a row bring nothing from the gateway,
6-8 s after a gateway froze (docs/native-protocol.md §3, docs/operations.md "High
availability").

Identity. A ``Client`` object is one client for the gateway across all its reconnects: it
sends the same ``client_name`` in every HELLO — the one given, else one generated when the
object is made (``keygate-py-<random>``). The gateway recognises the re-binds of a
reconnect by that name plus the partition set each consumer held (DESIGN.md §4
Rebalance), so a reconnect inside the rebalance delay keeps the partitions. A new
``Client`` object (a restarted process) re-binds with no previous set and is a newcomer.
"""

from __future__ import annotations

import functools
import ssl
import uuid
from collections.abc import Callable, Iterable, Mapping
from types import TracebackType
from typing import Final
from urllib.parse import urlsplit

from core.errors import InvalidArgument
from core.model import AckMode, GroupMode, KeyOrder, PropertyValue, QueueConfig, StartPosition
from gateway.client.consumer import BindIntent, Consumer
from gateway.client.errors import ConnectionLost
from gateway.client.robust import Backoff, Session
from protocols.native import (
    DeclareQueue,
    DeleteQueue,
    Hello,
    Publish,
    PublishOk,
    QueueOk,
    SettingValue,
)
from protocols.native.mapping import check_setting_names, queue_from_ok

DEFAULT_URL: Final = "keygate://127.0.0.1:55555"
DEFAULT_PORT: Final = 55555
# How long close() waits for the confirms of publishes in flight: a little longer than the
# gateway waits for their commits before it answers CLOSE (10 s), so its answers arrive.
CLOSE_TIMEOUT: Final = 15.0


def parse_url(url: str) -> tuple[tuple[tuple[str, int], ...], bool]:
    """``keygate://host:port`` (plain) or ``keygates://host:port`` (TLS), with several
    comma-separated addresses for active/standby gateways (``keygate://a:55555,b:55555``).
    Returns the addresses in order and whether TLS is on."""
    parts = urlsplit(url)
    if parts.scheme not in ("keygate", "keygates") or not parts.netloc:
        raise InvalidArgument(
            f"service URL must be keygate://host:port[,host:port…] or keygates://…, got {url!r}"
        )
    addresses: list[tuple[str, int]] = []
    for netloc in parts.netloc.split(","):
        one = urlsplit(f"//{netloc}")
        try:
            host, port = one.hostname, one.port
        except ValueError:  # a port that is not a number in 0..65535
            host = port = None
        if not host:
            raise InvalidArgument(f"bad address {netloc!r} in service URL {url!r}")
        addresses.append((host, port or DEFAULT_PORT))
    return tuple(addresses), parts.scheme == "keygates"


class Client:
    """A connection to a keygate gateway. Use ``async with Client(url) as client``."""

    def __init__(
        self,
        service_url: str = DEFAULT_URL,
        *,
        client_name: str | None = None,
        username: str | None = None,
        password: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        connect_timeout: float = 10.0,
        heartbeat: float = 2.0,
        backoff: Backoff | None = None,
        max_reconnect_attempts: int | None = None,
        max_frame: int = 0,
        ack_batch_size: int = 256,
        ack_flush_interval: float = 0.005,
        close_timeout: float = CLOSE_TIMEOUT,
    ) -> None:
        addresses, tls = parse_url(service_url)
        if tls and ssl_context is None:
            ssl_context = ssl.create_default_context()
        self._client_name = client_name or f"keygate-py-{uuid.uuid4().hex}"
        hello = Hello(
            client_name=self._client_name,
            username=username,
            password=password,
            max_frame=max_frame,
        )
        self._session = Session(
            addresses,
            hello,
            ssl_context=ssl_context,
            connect_timeout=connect_timeout,
            heartbeat=heartbeat,
            backoff=backoff or Backoff(),
            max_reconnect_attempts=max_reconnect_attempts,
            close_timeout=close_timeout,
        )
        self._ack_batch_size = ack_batch_size
        self._ack_flush_interval = ack_flush_interval
        self._consumers: list[Consumer] = []

    @property
    def client_name(self) -> str:
        """The name sent in every HELLO of this object: the one given or a generated one."""
        return self._client_name

    @property
    def session(self) -> Session:
        """The reconnecting layer (its ``reconnects`` counter, ``session_id``)."""
        return self._session

    async def connect(self) -> Client:
        """Connect and handshake; raises OSError/TimeoutError or the gateway's refusal
        (e.g. AuthenticationFailed). Later connection losses are handled by reconnecting."""
        await self._session.connect()
        return self

    async def __aenter__(self) -> Client:
        return await self.connect()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close gracefully; blocks until done. From the call on, new calls (a publish
        included) raise ClientClosed at once. Closes every consumer (flushing acks,
        unbinding), then the connection: sends CLOSE and waits, at most ``close_timeout``,
        for the gateway to confirm every publish still in flight — each then returns its
        message id or raises the gateway's error, as it would have without the close — and
        to answer CLOSE. Publishes still unconfirmed at the timeout, or when the connection
        drops meanwhile, raise ConnectionLost (outcome unknown)."""
        self._session.refuse()
        for consumer in list(self._consumers):
            await consumer.close()
        self._consumers.clear()
        await self._session.close()

    def abort(self) -> None:
        """Drop the connection without CLOSE or UNBIND and stop (does not block).

        What a crash looks like to the gateway (failover drills, tests, the demo):
        partitions are held through the rebalance delay, unacked messages redelivered.
        """
        self._consumers.clear()
        self._session.abort()

    # ------------------------------------------------------------- admin

    async def declare_queue(
        self,
        name: str,
        *,
        subscriptions: Iterable[str] | None = None,
        exist_ok: bool = True,
        passive: bool = False,
        **settings: SettingValue | None,
    ) -> QueueConfig:
        """Create queue ``name`` (settings named as QueueConfig's fields: partitions,
        max_deliveries, rebalance_delay, ...; None = default) or check it. Returns the
        queue as stored. Raises AlreadyExists, QueueNotFound (passive), InvalidArgument."""
        check_setting_names(settings)
        wire = {k: v for k, v in settings.items() if v is not None}
        subs = tuple(subscriptions) if subscriptions is not None else None
        conn = await self._session.connection()
        reply = await conn.request(
            lambda rid: DeclareQueue(
                request_id=rid,
                name=name,
                settings=wire,
                subscriptions=subs,
                exist_ok=exist_ok,
                passive=passive,
            )
        )
        assert isinstance(reply, QueueOk)
        return queue_from_ok(reply)

    async def delete_queue(self, name: str) -> None:
        """Delete a queue and its messages. Raises QueueNotFound."""
        conn = await self._session.connection()
        await conn.request(lambda rid: DeleteQueue(request_id=rid, name=name))

    # ------------------------------------------------------------- publishing

    async def publish(
        self,
        queue: str,
        payload: bytes,
        *,
        key: str | None = None,
        properties: Mapping[str, PropertyValue] | None = None,
        ttl: float | None = None,
        deliver_at: float | None = None,
        dedup_id: str | None = None,
        content_type: str | None = None,
        correlation_id: str | None = None,
        reply_to: str | None = None,
    ) -> str:
        """Publish to a queue; returns the message id once committed (blocks until then).
        ``ttl`` in seconds, ``deliver_at`` epoch seconds. Raises QueueNotFound,
        MessageTooLarge, QueueFull, ConnectionLost (outcome unknown; see module doc)."""
        ids = await self._publish(
            functools.partial(
                Publish,
                queue=queue,
                topic=None,
                key=key,
                payload=payload,
                properties=properties or {},
                ttl=ttl,
                deliver_at=deliver_at,
                dedup_id=dedup_id,
                content_type=content_type,
                correlation_id=correlation_id,
                reply_to=reply_to,
            )
        )
        return ids[0] if ids else ""

    async def publish_topic(
        self,
        topic: str,
        payload: bytes,
        *,
        key: str | None = None,
        properties: Mapping[str, PropertyValue] | None = None,
        ttl: float | None = None,
        deliver_at: float | None = None,
        dedup_id: str | None = None,
        content_type: str | None = None,
        correlation_id: str | None = None,
        reply_to: str | None = None,
    ) -> tuple[str, ...]:
        """Publish to a topic; returns one message id per queue it was stored in.
        Raises NoRoute when no queue subscribes to it."""
        return await self._publish(
            functools.partial(
                Publish,
                queue=None,
                topic=topic,
                key=key,
                payload=payload,
                properties=properties or {},
                ttl=ttl,
                deliver_at=deliver_at,
                dedup_id=dedup_id,
                content_type=content_type,
                correlation_id=correlation_id,
                reply_to=reply_to,
            )
        )

    async def _publish(self, publish: functools.partial[Publish]) -> tuple[str, ...]:
        """Send ``publish(request_id=...)`` until it is answered; after a lost connection
        again only if it has a dedup id (then the gateway stores it once)."""
        while True:
            conn = await self._session.connection()
            try:
                reply = await conn.request(lambda rid: publish(request_id=rid))
            except ConnectionLost:
                if publish.keywords["dedup_id"] is None or self._session.closed:
                    raise
                continue
            assert isinstance(reply, PublishOk)
            return reply.message_ids

    # ------------------------------------------------------------- consuming

    async def subscribe(
        self,
        queue: str,
        group: str,
        *,
        window: int = 0,
        ack_mode: AckMode | str = AckMode.CLIENT,
        tags: Mapping[str, str] | None = None,
        mode: GroupMode | str | None = None,
        key_order: KeyOrder | str | None = None,
        start: StartPosition | str | None = None,
        ack_timeout: float | None = None,
        on_partitions_changed: Callable[[frozenset[int]], None] | None = None,
    ) -> Consumer:
        """Bind a consumer to (queue, group); returns once the gateway confirmed, with
        ``consumer.partitions`` set. ``window`` 0 = the queue's default. Group settings
        left None keep the group's (or the defaults when this creates it). Raises
        QueueNotFound, Conflict (settings contradict the group), InvalidArgument."""
        intent = BindIntent(
            queue=queue,
            group=group,
            window=window,
            ack_mode=AckMode(ack_mode),
            tags=dict(tags) if tags is not None else None,
            mode=GroupMode(mode) if mode is not None else None,
            key_order=KeyOrder(key_order) if key_order is not None else None,
            start=StartPosition(start) if start is not None else None,
            ack_timeout=ack_timeout,
        )
        consumer = Consumer(
            self._session,
            intent,
            on_partitions_changed=on_partitions_changed,
            ack_batch_size=self._ack_batch_size,
            ack_flush_interval=self._ack_flush_interval,
        )
        conn = await self._session.connection()
        await consumer.bind(conn, previous=None)
        self._session.register(consumer)
        if not conn.is_open:
            # Lost between BIND_OK and registration: let the reconnect re-bind it.
            consumer.connection_lost()
        self._consumers.append(consumer)
        return consumer


__all__ = ["DEFAULT_URL", "Client", "parse_url"]
