"""The gateway process: opens the store, starts the broker and every enabled listener, and
shuts down gracefully (stop accepting, drain, flush acks, close the store).

Active/standby: gateways sharing one database elect the active one through a lease row in
``kg_gateway_lease`` (named after ``config.name``). A standby waits, its protocol ports
closed (its admin port answers only ``/healthz``, 503 "standby", and ``/api/status``, to
users), until the lease is free or has lapsed (by the database's clock), changing nothing
in the database meanwhile; it then
migrates the schema (if an older gateway left it behind) and takes the lease in one
transaction (storage.migrate). Taking it over increments the lease's epoch. The active
gateway fences its store with that epoch, so every write transaction proves in the
database that the lease is still its own.
It renews every ``lease_ttl / 3`` unless its writes renewed it meanwhile (they do, at most
every ``lease_ttl / 3``); a renewal that fails, whatever the error, is tried again
(gateway.lease_keeper). If a write is fenced off, a renewal finds the lease taken, or it
cannot renew within ``lease_ttl`` of the last renewal (before the lease can lapse in the
database), it stops at once (listeners closed together, no drain: nothing more can
commit) and the CLI exits non-zero. So it does when a critical background task ends while
it runs (gateway.supervisor). A clean stop lets the lease lapse, so a standby takes over
at once rather than after the TTL.
"""

from __future__ import annotations

import asyncio
import errno
import gc
import json
import logging
import os
import signal
import socket
import ssl
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from core.errors import (
    Fenced,
    InvalidArgument,
    KeygateError,
    SchemaBusy,
    SchemaTooNew,
    StorageError,
)
from gateway.broker import Broker
from gateway.config import LISTENERS, TLS_LISTENERS, GatewayConfig
from gateway.housekeeping import Housekeeping
from gateway.http import AdminServer
from gateway.http_server import HttpConnections
from gateway.lease_keeper import keep_lease
from gateway.metrics import Metrics
from gateway.security import check_security
from gateway.standby import StandbyHealth
from gateway.supervisor import Supervisor
from protocols._limits import ConnectionLimits
from protocols.mqtt.connection import MAX_SESSION_EXPIRY
from protocols.native.listener import NativeListener
from protocols.sink import Listener
from storage.engine import GATEWAY_APPLICATION, is_sqlite
from storage.fence import GatewayLease
from storage.migrate import LeaseClaim
from storage.store import SqlStore, open_store

# Young-generation allocations per pass, then passes per older-generation pass.
GC_THRESHOLDS: Final = (50_000, 20, 20)

log = logging.getLogger("keygate.server")


def tune_collector() -> None:
    """Set the garbage collector up for a started gateway (benchmarks.instructions does
    the same, so that it counts what the gateway does)."""
    # Everything alive now (modules, SQLAlchemy's caches, the broker) lives as long as
    # the process: keep it out of the collector's full passes, which otherwise stall
    # the event loop for tens of milliseconds (docs/performance.md).
    gc.collect()
    gc.freeze()
    # A publish allocates dozens of short-lived objects, nearly all freed by reference
    # counting; at the default 700 allocations per young pass the collector ran ~50
    # times per 1,000 messages (about 7 % of the gateway's CPU, docs/performance.md).
    gc.set_threshold(*GC_THRESHOLDS)


class PortInUse(KeygateError):
    code = "port-in-use"

    def __init__(self, listener: str, host: str, port: int) -> None:
        flag = f"--{listener}-port"
        super().__init__(
            f"cannot start the {listener} listener: {host}:{port} is already in use "
            f"(choose another port with {flag} N, 0 for any free port, or {flag} off)"
        )


def _listener(
    protocol: str,
    broker: Broker,
    store: SqlStore,
    config: GatewayConfig,
    ports: Mapping[str, int],
    limits: ConnectionLimits,
    http_connections: HttpConnections,
) -> Listener:
    # Imported here so that a protocol package is only loaded when its listener is on.
    if protocol == "native":
        return NativeListener(
            broker,
            server_name=config.name,
            write_buffer=config.consumer_write_buffer,
            idle_timeout=config.native_idle_timeout or None,
            limits=limits,
        )
    if protocol == "mqtt":
        from protocols.mqtt import MqttListener

        return MqttListener(broker, limits=limits)
    if protocol == "amqp":
        from protocols.amqp import AmqpListener

        return AmqpListener(broker, limits=limits, write_buffer=config.consumer_write_buffer)
    if protocol == "stomp":
        from protocols.stomp import StompListener

        return StompListener(broker, limits=limits, write_buffer=config.consumer_write_buffer)
    return AdminServer(broker, store, ports=ports, connections=http_connections)


def _http_connections(config: GatewayConfig) -> HttpConnections:
    return HttpConnections(config.max_http_connections, config.login_timeout)


def _listeners(
    broker: Broker, store: SqlStore, config: GatewayConfig, ports: Mapping[str, int]
) -> dict[str, Listener]:
    """Every enabled listener by name; a ``<protocol>_tls`` twin only with a certificate.
    They share one set of limits, so connections are counted across all of them (the
    HTTP ports against their own cap, ``max_http_connections``)."""
    limits = config.connection_limits()
    http_connections = _http_connections(config)
    broker.metrics.watch_connections(limits.connections.per_protocol)
    broker.metrics.watch_http_connections(lambda: http_connections.open)
    out: dict[str, Listener] = {}
    for name in LISTENERS:
        if config.port(name) is None or (name in TLS_LISTENERS and not config.tls_cert):
            continue
        protocol = name.removesuffix("_tls")
        out[name] = _listener(protocol, broker, store, config, ports, limits, http_connections)
    return out


# The ports file is written once at start and removed once at stop: tiny local file
# operations, done synchronously.
def _write_ports_file(name: str | None, ports: dict[str, int]) -> None:
    """Write the bound ports atomically, so a reader never sees a partial file."""
    if name:
        path = Path(name)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(ports))
        os.replace(tmp, path)


def _remove_ports_file(name: str | None) -> None:
    if name:
        Path(name).unlink(missing_ok=True)


def ssl_context(config: GatewayConfig) -> ssl.SSLContext | None:
    """The TLS listeners' context: TLS 1.2 or newer; with ``tls_ca``, client certificates
    signed by it are verified (and required with ``tls_require_client_cert``)."""
    if not config.tls_cert:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(config.tls_cert, config.tls_key)
        if config.tls_ca:
            context.load_verify_locations(config.tls_ca)
            context.verify_mode = (
                ssl.CERT_REQUIRED if config.tls_require_client_cert else ssl.CERT_OPTIONAL
            )
    except (OSError, ssl.SSLError) as e:
        raise InvalidArgument(f"cannot load the TLS certificate, key or CA: {e}") from e
    return context


@dataclass
class Gateway:
    config: GatewayConfig
    store: SqlStore | None = None
    broker: Broker | None = None
    ports: dict[str, int] = field(default_factory=dict)
    holder: str = field(
        default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    )
    lost_lease: bool = False
    # True once it stopped at once: the lease lost, or a critical task ended (exit 1).
    failed: bool = False
    # True once it stopped without closing its store: the database answered nothing.
    left_database: bool = False
    _listeners: dict[str, Listener] = field(default_factory=dict)
    _stopped: asyncio.Event = field(default_factory=asyncio.Event)
    _closed: asyncio.Event = field(default_factory=asyncio.Event)
    _lease_task: asyncio.Task[None] | None = None
    _stopping: asyncio.Task[None] | None = None
    _housekeeping: Housekeeping | None = None
    _active: bool = False
    _epoch: int = 0
    _supervisor: Supervisor | None = None

    async def start(self) -> None:
        """Open storage, wait to be the active gateway, start every enabled listener.

        Raises PortInUse naming the port. While another gateway is active this waits.
        """
        check_security(self.config)
        context = ssl_context(self.config)
        # A file left by an earlier run must not pass for this one's readiness.
        _remove_ports_file(self.config.ports_file)
        standby: StandbyHealth | None = None
        try:
            # The standby answers on the admin port as the active gateway will: plain on
            # `http`, or over TLS on `http_tls` when plain HTTP is off (it served TLS on
            # the plain port whenever a certificate was configured).
            admin = "http" if self.config.port("http") is not None else "http_tls"
            # http_tls has a port even without a certificate; it serves only with one.
            tls_off = admin == "http_tls" and context is None
            http_port = None if tls_off else self.config.port(admin)
            if http_port is not None:
                dialect = "sqlite" if is_sqlite(self.config.db) else "postgresql"
                standby = StandbyHealth(self.config, dialect, _http_connections(self.config))
                tls = context if admin == "http_tls" else None
                try:
                    await standby.start(self.config.host, http_port, tls)
                except OSError as e:
                    if e.errno == errno.EADDRINUSE:
                        raise PortInUse(admin, self.config.host, http_port) from e
                    raise
            self.store, waited = await self._open_store()
            await self._become_active(announced=waited)
            if standby is not None:
                await standby.close()
                standby = None
            # Another gateway may have written since the store was opened.
            await self.store.load_caches()
        except BaseException:
            if standby is not None:
                await standby.close()
            await self.stop()
            raise
        self._supervisor = Supervisor(self._task_ended)
        self._lease_task = asyncio.create_task(self._keep_lease(), name="lease keeper")
        self._supervisor.watch("the lease keeper", self._lease_task)
        for name, task in self.store.tasks().items():
            self._supervisor.watch(name, task)
        self.broker = Broker(self.store, self.config, Metrics())
        self.broker.metrics.active.set(1)
        # Flows of an earlier run (a crash leaves their rows) died with its connections.
        await self.store.forget_consumers(self.broker.groups.lease_owner)
        # Their MQTT sessions were never given an expiry: the longest a session may have.
        await self.store.orphan_mqtt_sessions(expires_at=time.time() + MAX_SESSION_EXPIRY)
        await self.broker.start()
        self._housekeeping = Housekeeping(self.broker, self.store, self._supervisor)
        self._supervisor.watch("housekeeping", self._housekeeping.start())
        try:
            for name, listener in _listeners(
                self.broker, self.store, self.config, self.ports
            ).items():
                port = self.config.port(name)
                assert port is not None
                tls = context if name in TLS_LISTENERS else None
                try:
                    self.ports[name] = await listener.start(self.config.host, port, tls)
                except OSError as e:
                    if e.errno == errno.EADDRINUSE:
                        raise PortInUse(name, self.config.host, port) from e
                    raise
                self._listeners[name] = listener
                self.broker.metrics.watch_listener(name, getattr(listener, "stats", None))
                log.info("%s listening on %s:%d", name, self.config.host, self.ports[name])
        except BaseException:
            await self.stop()
            raise
        _write_ports_file(self.config.ports_file, self.ports)

    async def _open_store(self) -> tuple[SqlStore, bool]:
        """Open the store, migrating the schema and taking the lease in one transaction
        (storage.migrate). While another gateway's lease is live this waits as a standby
        and changes nothing in the database: an older active gateway keeps writing to the
        schema it knows until it stops or its lease lapses (docs/operations.md, Upgrades).
        A database error once waiting is logged and tried again, as ``_try_acquire`` does;
        before that (a wrong URL, a database that is down) it fails the start. Returns the
        store and whether it waited."""
        claim = LeaseClaim(self.config.name, self.holder, self.config.lease_ttl)
        waiting = False
        busy = ""
        while True:
            try:
                store = await open_store(
                    self.config.db, application_name=GATEWAY_APPLICATION, claim=claim
                )
                return store, waiting
            except SchemaBusy as e:
                if not waiting:
                    log.info(
                        "standby: gateway %r is active elsewhere; taking over (and migrating "
                        "the schema if it is older) when its lease lapses: %s",
                        self.config.name,
                        e,
                    )
                elif e.message != busy:
                    # What it waits for changed (the lease lapsed, its row is still locked).
                    log.warning("standby: %s; trying again", e)
                waiting, busy = True, e.message
            except StorageError as e:
                if not waiting or isinstance(e, SchemaTooNew):
                    raise
                log.warning("standby: opening the store failed: %s; trying again", e)
            await asyncio.sleep(self.config.lease_ttl / 3)

    async def _acquire(self, epoch: int | None = None) -> int | None:
        assert self.store is not None
        return await self.store.acquire_gateway_lease(
            self.config.name, self.holder, ttl=self.config.lease_ttl, epoch=epoch
        )

    async def _try_acquire(self) -> int | None:
        """``_acquire`` for a standby, which must outlive what a database does meanwhile:
        unreachable for a while (a restart), or the lease row held past the lock timeout
        by the old active's last write. Either is logged and tried again at the next poll."""
        try:
            return await self._acquire()
        except KeygateError as e:
            log.warning("standby: taking the gateway lease failed: %s; trying again", e)
            return None

    async def _become_active(self, *, announced: bool) -> None:
        """Take the lease (at once when ``_open_store`` took it) or wait for it;
        ``announced``: the standby log line was written already."""
        assert self.store is not None
        while (epoch := await self._try_acquire()) is None:
            if not announced:
                log.info(
                    "standby: gateway %r is active elsewhere; taking over when its lease lapses",
                    self.config.name,
                )
                announced = True
            await asyncio.sleep(self.config.lease_ttl / 3)
        self._epoch = epoch
        lease = GatewayLease(self.config.name, self.holder, epoch, self.config.lease_ttl)
        self.store.fence(lease, self._fenced_off)
        self._active = True
        if announced:
            log.info("took over as the active gateway %r (epoch %d)", self.config.name, epoch)

    async def _keep_lease(self) -> None:
        """Renew the lease until it is lost (gateway.lease_keeper), then stop at once."""
        assert self.store is not None
        store = self.store

        async def renew() -> bool:
            return await self._acquire(self._epoch) is not None

        await keep_lease(
            renew, lambda: store.lease_renewed_at, self._lose_lease, ttl=self.config.lease_ttl
        )

    def _task_ended(self, why: str) -> None:
        """A critical background task ended while the gateway runs (gateway.supervisor)."""
        self._stop_at_once(why)

    def _fenced_off(self, error: Fenced) -> None:
        self._lose_lease(f"a write was fenced off ({error.message})")

    def _lose_lease(self, why: str) -> None:
        """Another gateway is (or may be) active: stop at once, without releasing."""
        if self.lost_lease:
            return
        self.lost_lease = True
        self._active = False
        self._stop_at_once(why, "so that one gateway stays active")

    def _stop_at_once(self, why: str, purpose: str = "") -> None:
        """Stop without draining (the lease released only while still ours); exit 1."""
        if self.failed or self._stopped.is_set():
            return
        log.error("%s; stopping at once%s", why, f" {purpose}" if purpose else "")
        self.failed = True
        if self.broker is not None:
            self.broker.metrics.active.set(0)
        # stop() cancels the lease task, so it must not run inside it.
        self._stopping = asyncio.create_task(self.stop())

    async def stop(self) -> None:
        """Stop accepting, close connections, flush acks, release the lease, close the
        store. Idempotent: a second call returns when the first has finished."""
        if self._stopped.is_set():
            await self._closed.wait()  # a stop is under way: return when it is done
            return
        self._stopped.set()
        try:
            await self._shut_down()
        finally:
            self._closed.set()
        log.info("gateway stopped")

    async def _shut_down(self) -> None:
        if self._supervisor is not None:
            self._supervisor.stand_down()
        if self._lease_task is not None and self._lease_task is not asyncio.current_task():
            self._lease_task.cancel()
        # Together: a stop drains for as long as its slowest listener (that one's
        # DRAIN_TIMEOUT at most), not for the sum of them.
        await asyncio.gather(*(self._close(*item) for item in self._listeners.items()))
        self._listeners.clear()
        if self.ports:
            _remove_ports_file(self.config.ports_file)
        # When the database does not answer at all (the link is a black hole: nothing is
        # refused, nothing comes back) the final writes and the store's close would wait
        # for as long: give them lease_ttl — the lease is lost by then anyway — then leave
        # them. Left, not cancelled and awaited: a query cancelled on such a link does not
        # end either (asyncpg sends the cancel request over a new connection, which
        # hangs in turn). What the store still holds was never confirmed: its clients
        # send it again.
        closing = asyncio.create_task(self._close_storage(), name="closing the store")
        if (await asyncio.wait((closing,), timeout=self.config.lease_ttl))[0]:
            closing.result()  # raises what closing raised
            return
        closing.cancel()
        self.left_database = True
        unconfirmed = self.store.appender.backlog if self.store is not None else 0
        log.error(
            "the database did not answer within lease_ttl (%g s): stopping without it; "
            "%d publish(es) received were not confirmed and may not be stored (their "
            "clients got no confirm, or an error); nothing confirmed is lost",
            self.config.lease_ttl,
            unconfirmed,
        )

    async def _close_storage(self) -> None:
        if self._housekeeping is not None:
            await self._housekeeping.stop()
        if self.broker is not None:
            await self.broker.close()
        if self.store is not None:
            if self._active:
                try:
                    await self.store.release_gateway_lease(self.config.name, self.holder)
                except KeygateError as e:
                    log.warning("releasing the gateway lease failed: %s", e)
            await self.store.close()

    @staticmethod
    async def _close(name: str, listener: Listener) -> None:
        try:
            await listener.close()
        except Exception:
            log.exception("closing the %s listener failed", name)

    async def wait_closed(self) -> None:
        """Return once a stop (asked for, or after losing the lease) has finished."""
        await self._closed.wait()

    async def serve_forever(self) -> None:
        """Start, run until SIGTERM/SIGINT, then stop gracefully."""
        await self.start()
        tune_collector()
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            stopped = asyncio.create_task(self._stopped.wait())
            signalled = asyncio.create_task(stop.wait())
            await asyncio.wait([stopped, signalled], return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            signalled.cancel()
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
            await self.stop()
