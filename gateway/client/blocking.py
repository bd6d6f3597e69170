"""The blocking SDK: ``Client``'s shape for threaded code.

A ``BlockingClient`` starts a private event loop in a daemon thread and runs the asyncio
``Client`` there; each method submits a coroutine to that loop and blocks the calling
thread until it finishes. Several threads may call one client at once (publishes from
several threads are pipelined on the one connection). ``on_partitions_changed`` callbacks
run in the loop's thread and must not block.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine, Iterable, Iterator, Mapping
from types import TracebackType
from typing import Any, TypeVar

from core.model import PropertyValue, QueueConfig
from gateway.client.client import Client
from gateway.client.consumer import Consumer, Message
from gateway.client.errors import ConsumerClosed
from protocols.native import SettingValue

T = TypeVar("T")


class _LoopThread:
    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="keygate-client", daemon=True
        )
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("blocking keygate call from the client's own loop thread")
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


class BlockingConsumer:
    """The blocking twin of ``Consumer``; every method blocks until done."""

    def __init__(self, consumer: Consumer, runner: _LoopThread) -> None:
        self._consumer = consumer
        self._run = runner.run

    @property
    def partitions(self) -> frozenset[int]:
        return self._consumer.partitions

    def receive(self, timeout: float | None = None) -> Message:
        """Blocks until a message arrives or ``timeout`` passes (TimeoutError)."""
        return self._run(self._consumer.receive(timeout))

    def batch_receive(self, max_messages: int = 100, timeout: float | None = 0.1) -> list[Message]:
        """Blocks up to ``timeout``; see Consumer.batch_receive."""
        return self._run(self._consumer.batch_receive(max_messages, timeout))

    def __iter__(self) -> Iterator[Message]:
        """Blocking iteration until the consumer is closed."""
        while True:
            try:
                yield self.receive()
            except ConsumerClosed:
                return

    def acknowledge(self, message: Message) -> None:
        """Returns at once unless an ack batch is full (then blocks to send it)."""
        self._run(self._consumer.acknowledge(message))

    def acknowledge_cumulative(self, message: Message) -> None:
        self._run(self._consumer.acknowledge_cumulative(message))

    def negative_acknowledge(self, message: Message, delay: float | None = None) -> None:
        self._run(self._consumer.negative_acknowledge(message, delay))

    def reject(self, message: Message) -> None:
        self._run(self._consumer.reject(message))

    def set_window(self, window: int) -> None:
        self._run(self._consumer.set_window(window))

    def close(self, shutdown: bool = False) -> None:
        """Blocks until the gateway confirmed the unbind."""
        self._run(self._consumer.close(shutdown))


class BlockingClient:
    """The blocking twin of ``Client``: same arguments and methods; each call blocks the
    calling thread until the gateway answers. Connects in the constructor."""

    def __init__(self, service_url: str = "keygate://127.0.0.1:55555", **options: Any) -> None:
        self._runner = _LoopThread()
        try:
            self._client = self._runner.run(_make_client(service_url, options))
            self._runner.run(self._client.connect())
        except BaseException:
            self._runner.stop()
            raise

    def __enter__(self) -> BlockingClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Close consumers and the connection, then stop the loop thread."""
        try:
            self._runner.run(self._client.close())
        finally:
            self._runner.stop()

    def declare_queue(
        self,
        name: str,
        *,
        subscriptions: Iterable[str] | None = None,
        exist_ok: bool = True,
        passive: bool = False,
        **settings: SettingValue | None,
    ) -> QueueConfig:
        return self._runner.run(
            self._client.declare_queue(
                name, subscriptions=subscriptions, exist_ok=exist_ok, passive=passive, **settings
            )
        )

    def delete_queue(self, name: str) -> None:
        self._runner.run(self._client.delete_queue(name))

    def publish(
        self,
        queue: str,
        payload: bytes,
        *,
        key: str | None = None,
        properties: Mapping[str, PropertyValue] | None = None,
        **options: Any,
    ) -> str:
        """Blocks until the message is committed; returns its id."""
        return self._runner.run(
            self._client.publish(queue, payload, key=key, properties=properties, **options)
        )

    def publish_topic(
        self,
        topic: str,
        payload: bytes,
        *,
        key: str | None = None,
        properties: Mapping[str, PropertyValue] | None = None,
        **options: Any,
    ) -> tuple[str, ...]:
        """Blocks until committed; returns one id per queue reached."""
        return self._runner.run(
            self._client.publish_topic(topic, payload, key=key, properties=properties, **options)
        )

    def subscribe(
        self,
        queue: str,
        group: str,
        *,
        on_partitions_changed: Callable[[frozenset[int]], None] | None = None,
        **options: Any,
    ) -> BlockingConsumer:
        """Blocks until bound; options as Client.subscribe."""
        consumer = self._runner.run(
            self._client.subscribe(
                queue, group, on_partitions_changed=on_partitions_changed, **options
            )
        )
        return BlockingConsumer(consumer, self._runner)


async def _make_client(service_url: str, options: dict[str, Any]) -> Client:
    # Built inside the loop thread so its asyncio objects belong to that loop.
    return Client(service_url, **options)


__all__ = ["BlockingClient", "BlockingConsumer"]
