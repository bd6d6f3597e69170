"""Real AMQP (pika) and STOMP (stomp.py) consumers for integration tests.

Both libraries are blocking: each consumer runs its client in a thread and records every
delivery it sees (thread-safe); tests wait on the records with a deadline. ``ack`` decides
per delivery what the consumer answers: "ack", "nack" (retry), "reject" (dead-letter) or
"hold" (leave it unacked).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pika
import stomp

from gateway.server import Gateway

Policy = Callable[["Received"], str]


@dataclass(frozen=True)
class Received:
    body: bytes
    headers: dict[str, Any]
    redelivered: bool
    tag: Any  # AMQP delivery tag or STOMP ack id

    @property
    def partition(self) -> int:
        return int(self.headers["x-partition"])

    @property
    def key(self) -> str:
        return str(self.headers["JMSXGroupID"])


def always_ack(_: Received) -> str:
    return "ack"


class Recorded:
    """Deliveries seen by one consumer, waitable from the test's event loop thread."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.received: list[Received] = []

    def add(self, item: Received) -> None:
        with self._cond:
            self.received.append(item)
            self._cond.notify_all()

    def snapshot(self) -> list[Received]:
        with self._cond:
            return list(self.received)

    def wait_for(self, count: int, timeout: float = 15.0) -> list[Received]:
        """Block (in a worker thread) until ``count`` deliveries arrived."""
        with self._cond:
            assert self._cond.wait_for(lambda: len(self.received) >= count, timeout), (
                f"{len(self.received)} of {count} deliveries"
            )
            return list(self.received)


class PikaConsumer(Recorded):
    """``basic.consume`` on ``queue`` in a thread; ``stop()`` closes the connection."""

    def __init__(
        self,
        port: int,
        queue: str,
        *,
        group: str = "default",
        prefetch: int = 0,
        policy: Policy = always_ack,
    ) -> None:
        super().__init__()
        self._params = pika.ConnectionParameters("127.0.0.1", port, connection_attempts=1)
        self._queue, self._group, self._prefetch, self._policy = queue, group, prefetch, policy
        self._connection: pika.BlockingConnection | None = None
        self._channel: Any = None
        self._consuming = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.error: BaseException | None = None

    def start(self) -> PikaConsumer:
        self._thread.start()
        assert self._consuming.wait(15), "pika consumer did not start"
        return self

    def _run(self) -> None:
        try:
            self._connection = pika.BlockingConnection(self._params)
            channel = self._channel = self._connection.channel()
            if self._prefetch:
                channel.basic_qos(prefetch_count=self._prefetch)
            channel.basic_consume(self._queue, self._on_message, arguments={"x-group": self._group})
            self._consuming.set()
            channel.start_consuming()
        except BaseException as e:  # a dropped connection ends the thread; tests look
            self.error = e
            self._consuming.set()

    def _on_message(self, channel: Any, method: Any, properties: Any, body: bytes) -> None:
        item = Received(
            body, dict(properties.headers or {}), method.redelivered, method.delivery_tag
        )
        self.add(item)
        answer = self._policy(item)
        if answer == "ack":
            channel.basic_ack(method.delivery_tag)
        elif answer == "nack":
            channel.basic_nack(method.delivery_tag, requeue=True)
        elif answer == "reject":
            channel.basic_reject(method.delivery_tag, requeue=False)

    def ack(self, tag: Any) -> None:
        """Ack a held delivery from any thread."""
        assert self._connection is not None and self._channel is not None
        channel = self._channel
        self._connection.add_callback_threadsafe(lambda: channel.basic_ack(tag))

    def stop(self) -> None:
        connection = self._connection
        if connection is not None and connection.is_open:
            connection.add_callback_threadsafe(connection.close)
        self._thread.join(15)


class StompConsumer(stomp.ConnectionListener, Recorded):  # type: ignore[misc]
    """A stomp.py 1.2 subscription to ``/queue/QUEUE`` with ``ack:client-individual``."""

    def __init__(
        self,
        gateway: Gateway,
        queue: str,
        *,
        group: str = "default",
        prefetch: int = 0,
        policy: Policy = always_ack,
        ack: str = "client-individual",
    ) -> None:
        Recorded.__init__(self)
        self._policy = policy
        self.conn = stomp.Connection12([("127.0.0.1", gateway.ports["stomp"])])
        self.conn.set_listener("consumer", self)
        self.conn.connect(wait=True)
        headers = {"x-group": group}
        if prefetch:
            headers["prefetch-count"] = str(prefetch)
        self.conn.subscribe(f"/queue/{queue}", id="s1", ack=ack, headers=headers)

    def on_message(self, frame: Any) -> None:
        headers = dict(frame.headers)
        body = frame.body if isinstance(frame.body, bytes) else frame.body.encode()
        item = Received(body, headers, headers.get("redelivered") == "true", headers.get("ack"))
        self.add(item)
        answer = self._policy(item)
        if item.tag is None:
            return  # ack:auto
        if answer == "ack":
            self.conn.ack(item.tag)
        elif answer == "nack":
            self.conn.nack(item.tag)

    def stop(self) -> None:
        # The gateway may have closed the socket (an ERROR): DISCONNECT then fails.
        with contextlib.suppress(OSError, stomp.exception.NotConnectedException):
            if self.conn.is_connected():
                self.conn.disconnect()


def wait_until(check: Callable[[], bool], timeout: float = 15.0, what: str = "condition") -> None:
    """Poll ``check`` (in a worker thread) until it holds or the deadline passes."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)
