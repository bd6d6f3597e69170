"""The reconnecting layer: one live ``Connection`` at a time, and the intent to replay.

How it works (aio-pika's robust connection, nats.py's backoff): the session keeps the
consumers that are bound — their bind settings and windows are the intent. When the
connection is lost it tells every consumer (which drop their unsettled deliveries), then a
single reconnect task sleeps a jittered, capped exponential delay, opens a new connection
(HELLO again) and re-binds every consumer with ``previous_partitions`` = the set it held.
Only then are waiting requests released onto the new connection. Requests that were in
flight at the cut fail with ``ConnectionLost``; nothing is resent here (a publish may have
been stored: resending could duplicate it — the client resends only when it carries a
dedup id). Queue declarations are not replayed: they are durable on the gateway.

Several addresses (active/standby gateways): every connect and reconnect tries them in
turn, so the client follows whichever gateway is active.
"""

from __future__ import annotations

import asyncio
import logging
import random
import ssl
from collections.abc import Sequence
from dataclasses import dataclass

from core.errors import KeygateError
from gateway.client.connection import Connection
from gateway.client.consumer import Consumer
from gateway.client.errors import ClientClosed, ConnectionLost
from protocols.native import Hello

log = logging.getLogger("keygate.client")


@dataclass(frozen=True, slots=True)
class Backoff:
    """Reconnect delays: ``initial * multiplier**attempt`` capped at ``maximum``, minus up
    to ``jitter`` of it at random so that clients cut together do not return together."""

    initial: float = 0.1
    maximum: float = 10.0
    multiplier: float = 2.0
    jitter: float = 0.5

    def delay(self, attempt: int, rng: random.Random) -> float:
        base = min(self.maximum, self.initial * self.multiplier ** min(attempt, 64))
        return base * (1.0 - self.jitter * rng.random())


class Session:
    """Owns the current connection and reconnects it; consumers register their intent."""

    def __init__(
        self,
        addresses: Sequence[tuple[str, int]],
        hello: Hello,
        *,
        ssl_context: ssl.SSLContext | None,
        connect_timeout: float,
        heartbeat: float,
        backoff: Backoff,
        max_reconnect_attempts: int | None,
        close_timeout: float,
        rng: random.Random | None = None,
    ) -> None:
        if not addresses:
            raise ValueError("a session needs at least one address")
        self._addresses, self._hello = tuple(addresses), hello
        # Index of the address the current (or last) connection went to.
        self._current = 0
        self._ssl = ssl_context
        self._connect_timeout = connect_timeout
        self._heartbeat = heartbeat
        self._backoff = backoff
        self._max_attempts = max_reconnect_attempts
        self._close_timeout = close_timeout
        self._rng = rng or random.Random()
        self._conn: Connection | None = None
        self._ready = asyncio.Event()
        self._consumers: list[Consumer] = []
        self._reconnect_task: asyncio.Task[None] | None = None
        self._error: BaseException | None = None
        self.reconnects = 0

    @property
    def session_id(self) -> str | None:
        return self._conn.session_id if self._conn is not None else None

    @property
    def closed(self) -> bool:
        """Closed, closing or given up: every call is refused."""
        return self._error is not None

    async def connect(self) -> None:
        """First connection; its failure is raised (no retry)."""
        self._conn = await self._open()
        self._ready.set()

    async def connection(self) -> Connection:
        """The live connection; blocks while reconnecting. Raises ClientClosed once the
        client is closed or has given up reconnecting."""
        while True:
            if self._error is not None:
                raise ClientClosed(str(self._error)) from self._error
            conn = self._conn
            # Invariant: _ready is set only while _conn is open and re-bound (or on error).
            if self._ready.is_set() and conn is not None and conn.is_open:
                return conn
            await self._ready.wait()

    def register(self, consumer: Consumer) -> None:
        self._consumers.append(consumer)

    def forget(self, consumer: Consumer) -> None:
        if consumer in self._consumers:
            self._consumers.remove(consumer)

    def refuse(self) -> None:
        """Refuse every call from now on (ClientClosed), never reconnect: ``close`` has
        begun. Calls already sent are answered as usual."""
        if self._error is None:
            self._error = ClientClosed("the client is closed: close() was called")
        self._ready.set()

    async def close(self) -> None:
        """Stop reconnecting and close the connection gracefully: the gateway's answers to
        the requests in flight (their publishes' confirms) are awaited, at most
        ``close_timeout`` (Connection.close)."""
        self.refuse()
        task, self._reconnect_task = self._reconnect_task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        assert self._error is not None
        for consumer in self._consumers:
            consumer.fail(self._error)
        self._consumers.clear()
        conn, self._conn = self._conn, None
        if conn is not None:
            await conn.close(self._close_timeout)

    def abort(self) -> None:
        """Stop at once: drop the socket without CLOSE or UNBIND and never reconnect.

        The gateway sees exactly what it sees when the client's process dies: the flows'
        partitions go unbound for the rebalance delay and their unacked messages are
        redelivered. Consumers fail with ClientClosed.
        """
        if self._error is None:
            self._error = ClientClosed("the client was aborted")
        if self._reconnect_task is not None:
            self._reconnect_task.cancel()
        self._ready.set()
        for consumer in self._consumers:
            consumer.fail(self._error)
        self._consumers.clear()
        if self._conn is not None:
            self._conn.abort()

    async def _open(self) -> Connection:
        """Connect to the first address that answers, trying each once in turn, starting
        with the one after the address last connected to when that connection was lost (a
        standby keeps its ports closed, so a refused address costs one round trip)."""
        start = self._current + (1 if self._conn is not None else 0)
        error: BaseException | None = None
        for step in range(len(self._addresses)):
            index = (start + step) % len(self._addresses)
            host, port = self._addresses[index]
            try:
                conn = await Connection.open(
                    host,
                    port,
                    self._hello,
                    ssl_context=self._ssl,
                    connect_timeout=self._connect_timeout,
                    heartbeat=self._heartbeat,
                    on_lost=self._lost,
                )
            except (OSError, TimeoutError, KeygateError) as e:
                if len(self._addresses) > 1:
                    log.info("keygate gateway %s:%d did not answer: %s", host, port, e)
                error = e
                continue
            self._current = index
            return conn
        assert error is not None
        raise error

    def _lost(self, conn: Connection, reason: BaseException) -> None:
        if conn is not self._conn or self._error is not None:
            return
        log.warning("keygate connection lost (%s); reconnecting", reason)
        self._ready.clear()
        for consumer in self._consumers:
            consumer.connection_lost()
        if self._reconnect_task is None or self._reconnect_task.done():
            self._reconnect_task = asyncio.create_task(self._reconnect(), name="keygate-reconnect")

    async def _reconnect(self) -> None:
        attempt = 0
        while self._error is None:
            await asyncio.sleep(self._backoff.delay(attempt, self._rng))
            attempt += 1
            try:
                conn = await self._open()
            except (OSError, TimeoutError, KeygateError) as e:
                log.info("keygate reconnect attempt %d failed: %s", attempt, e)
                if self._max_attempts is not None and attempt >= self._max_attempts:
                    self._give_up(e)
                    return
                continue
            self._conn = conn
            await self._rebind(conn)
            if conn.is_open:
                self.reconnects += 1
                self._ready.set()
                return

    async def _rebind(self, conn: Connection) -> None:
        for consumer in list(self._consumers):
            try:
                await consumer.bind(conn, previous=consumer.partitions)
            except ConnectionLost:
                return
            except KeygateError as e:
                log.error(
                    "keygate consumer %s/%s could not re-bind: %s",
                    consumer.queue,
                    consumer.group,
                    e,
                )
                self.forget(consumer)
                consumer.fail(e)

    def _give_up(self, error: BaseException) -> None:
        self._error = ConnectionLost(f"gave up reconnecting: {error}")
        self._error.__cause__ = error
        self._ready.set()
        for consumer in self._consumers:
            consumer.fail(self._error)
        self._consumers.clear()


__all__ = ["Backoff", "Session"]
