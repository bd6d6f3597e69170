"""The gateway process: opens the store, starts the broker and every enabled listener, and
shuts down gracefully (stop accepting, drain, flush acks, close the store)."""

from __future__ import annotations

import asyncio
import errno
import json
import logging
import os
import signal
import ssl
from dataclasses import dataclass, field
from pathlib import Path

from core.errors import KeygateError
from gateway.broker import Broker
from gateway.config import GatewayConfig
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
    if config.port("native") is not None:
        out["native"] = NativeListener(broker, server_name=config.name)
    if config.port("mqtt") is not None:
        from protocols.mqtt import MqttListener

        out["mqtt"] = MqttListener(broker)
    if config.port("amqp") is not None:
        from protocols.amqp import AmqpListener

        out["amqp"] = AmqpListener(broker)
    if config.port("stomp") is not None:
        from protocols.stomp import StompListener

        out["stomp"] = StompListener(broker)
    if config.port("http") is not None:
        out["http"] = AdminServer(broker)
    return out


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
    _listeners: dict[str, Listener] = field(default_factory=dict)
    _stopped: asyncio.Event = field(default_factory=asyncio.Event)

    async def start(self) -> None:
        """Open storage and start every enabled listener; raise PortInUse naming the port."""
        self.store = await open_store(self.config.db)
        self.broker = Broker(self.store, self.config, Metrics())
        await self.broker.start()
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
                log.info("%s listening on %s:%d", name, self.config.host, self.ports[name])
        except BaseException:
            await self.stop()
            raise
        if self.config.ports_file:
            path = Path(self.config.ports_file)
            tmp = path.with_suffix(path.suffix + ".tmp")
            tmp.write_text(json.dumps(self.ports))
            os.replace(tmp, path)

    async def stop(self) -> None:
        """Stop accepting, close connections, flush acks, close the store. Idempotent."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        for name, listener in reversed(list(self._listeners.items())):
            try:
                await listener.close()
            except Exception:
                log.exception("closing the %s listener failed", name)
        self._listeners.clear()
        if self.broker is not None:
            await self.broker.close()
        if self.store is not None:
            await self.store.close()
        log.info("gateway stopped")

    async def serve_forever(self) -> None:
        """Start, run until SIGTERM/SIGINT, then stop gracefully."""
        await self.start()
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
            await self.stop()
