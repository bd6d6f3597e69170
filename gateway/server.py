"""The gateway process: opens the store, starts the broker and every enabled listener, and
shuts down gracefully (stop accepting, drain, flush acks, close the store).

Active/standby: gateways sharing one database elect the active one through a lease row in
``kg_gateway_lease`` (named after ``config.name``). A standby opens the store and waits,
accepting no connections, until the lease is free or has lapsed; the active gateway renews
every ``lease_ttl / 3`` and, if it cannot renew within ``lease_ttl`` (or finds the lease
taken), stops itself so two gateways never append at once. A clean stop releases the lease,
so a standby takes over at once rather than after the TTL.
"""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import signal
import socket
import ssl
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from core.errors import KeygateError
from gateway.broker import Broker
from gateway.config import GatewayConfig
from gateway.housekeeping import Housekeeping
from gateway.http import AdminServer
from gateway.metrics import Metrics
from gateway.native_listener import NativeListener
from protocols.sink import Listener
from storage.store import SqlStore, open_store

log = logging.getLogger("keygate.server")


class PortInUse(KeygateError):
    code = "port-in-use"

    def __init__(self, listener: str, host: str, port: int) -> None:
        flag = f"--{listener}-port"
        super().__init__(
            f"cannot start the {listener} listener: {host}:{port} is already in use "
            f"(choose another port with {flag} N, 0 for any free port, or {flag} off)"
        )


def _listeners(broker: Broker, config: GatewayConfig) -> dict[str, Listener]:
    # Imported here so that a protocol package is only loaded when its listener is on.
    out: dict[str, Listener] = {}
    limits = config.connection_limits()
    if config.port("native") is not None:
        out["native"] = NativeListener(broker, server_name=config.name, limits=limits)
    if config.port("mqtt") is not None:
        from protocols.mqtt import MqttListener

        out["mqtt"] = MqttListener(broker, limits=limits)
    if config.port("amqp") is not None:
        from protocols.amqp import AmqpListener

        out["amqp"] = AmqpListener(broker, limits=limits)
    if config.port("stomp") is not None:
        from protocols.stomp import StompListener

        out["stomp"] = StompListener(broker, limits=limits)
    if config.port("http") is not None:
        out["http"] = AdminServer(broker)
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
    if not config.tls_cert:
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(config.tls_cert, config.tls_key)
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
    _listeners: dict[str, Listener] = field(default_factory=dict)
    _stopped: asyncio.Event = field(default_factory=asyncio.Event)
    _closed: asyncio.Event = field(default_factory=asyncio.Event)
    _lease_task: asyncio.Task[None] | None = None
    _stopping: asyncio.Task[None] | None = None
    _housekeeping: Housekeeping | None = None
    _active: bool = False

    async def start(self) -> None:
        """Open storage, wait to be the active gateway, start every enabled listener.

        Raises PortInUse naming the port. While another gateway is active this waits.
        """
        # A file left by an earlier run must not pass for this one's readiness.
        _remove_ports_file(self.config.ports_file)
        self.store = await open_store(self.config.db)
        try:
            await self._become_active()
            # Another gateway may have written since the store was opened.
            await self.store.load_caches()
        except BaseException:
            await self.stop()
            raise
        self._lease_task = asyncio.create_task(self._keep_lease())
        self.broker = Broker(self.store, self.config, Metrics())
        # Flows of an earlier run (a crash leaves their rows) died with its connections.
        await self.store.forget_consumers(self.broker.lease_owner)
        await self.broker.start()
        self._housekeeping = Housekeeping(self.broker)
        self._housekeeping.start()
        context = ssl_context(self.config)
        try:
            for name, listener in _listeners(self.broker, self.config).items():
                port = self.config.port(name)
                assert port is not None
                try:
                    self.ports[name] = await listener.start(self.config.host, port, context)
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

    async def _acquire(self) -> bool:
        assert self.store is not None
        return await self.store.acquire_gateway_lease(
            self.config.name, self.holder, ttl=self.config.lease_ttl, now=time.time()
        )

    async def _become_active(self) -> None:
        announced = False
        while not await self._acquire():
            if not announced:
                log.info(
                    "standby: gateway %r is active elsewhere; taking over when its lease lapses",
                    self.config.name,
                )
                announced = True
            await asyncio.sleep(self.config.lease_ttl / 3)
        self._active = True
        if announced:
            log.info("took over as the active gateway %r", self.config.name)

    async def _keep_lease(self) -> None:
        renewed = time.monotonic()
        while True:
            await asyncio.sleep(self.config.lease_ttl / 3)
            try:
                held = await self._acquire()
            except KeygateError as e:
                log.warning("renewing the gateway lease failed: %s", e)
                held = time.monotonic() - renewed < self.config.lease_ttl
            else:
                renewed = time.monotonic() if held else renewed
            if not held:
                log.error("lost the gateway lease; stopping so that one gateway stays active")
                self.lost_lease = True
                self._active = False
                # stop() cancels the lease task, so it must not run inside it.
                self._stopping = asyncio.create_task(self.stop())
                return

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
        if self._lease_task is not None and self._lease_task is not asyncio.current_task():
            self._lease_task.cancel()
        for name, listener in reversed(list(self._listeners.items())):
            try:
                await listener.close()
            except Exception:
                log.exception("closing the %s listener failed", name)
        self._listeners.clear()
        if self.ports:
            _remove_ports_file(self.config.ports_file)
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

    async def wait_closed(self) -> None:
        """Return once a stop (asked for, or after losing the lease) has finished."""
        await self._closed.wait()

    async def serve_forever(self) -> None:
        """Start, run until SIGTERM/SIGINT, then stop gracefully."""
        await self.start()
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
