"""A small scripted gateway speaking the real native codec through ServerConnection.

It records every event it receives, answers requests the simple way (publishes go to a
per-queue list, BIND assigns ``partitions_for_bind``, CLOSE is answered with CLOSE), and
lets a test push DELIVER and PARTITIONS_CHANGED frames, hold publish confirmations and the
answer to CLOSE, and cut connections.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from core.model import GroupMode
from protocols.native import (
    Bind,
    BindOk,
    Close,
    DeclareQueue,
    DeleteQueue,
    Deliver,
    Error,
    Event,
    Hello,
    NativeProtocolError,
    Ok,
    PartitionsChanged,
    Ping,
    Pong,
    Publish,
    PublishOk,
    QueueOk,
    ServerConnection,
    Unbind,
)

E = TypeVar("E")


@dataclass
class Peer:
    conn: ServerConnection
    writer: asyncio.StreamWriter
    flows: list[str] = field(default_factory=list)

    def send(self, event: Event) -> None:
        self.writer.write(self.conn.send(event))


class FakeGateway:
    def __init__(self) -> None:
        self.received: list[Event] = []
        self.sessions: list[Peer] = []
        self.queues: dict[str, int] = {}
        self.password: str | None = None
        self.hold_publishes = False
        # CLOSE is answered only at release_close(), as the gateway answers it once the
        # publishes sent before it are confirmed.
        self.hold_close = False
        self._closing: list[Peer] = []
        self.answer_pings = True
        self.partitions_for_bind: Callable[[Bind], frozenset[int]] = lambda bind: (
            bind.previous_partitions if bind.previous_partitions is not None else frozenset({0, 1})
        )
        self.flow_ids: dict[str, Peer] = {}
        self._ids = itertools.count(1)
        self._changed = asyncio.Condition()
        self._server: asyncio.Server | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"keygate://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        self.drop_connections()
        await self._server.wait_closed()

    def of_type(self, kind: type[E]) -> list[E]:
        return [e for e in self.received if isinstance(e, kind)]

    async def wait_for(self, predicate: Callable[[], bool], within: float = 5.0) -> None:
        """Wait until ``predicate`` holds, re-checked after each received event."""
        async with asyncio.timeout(within), self._changed:
            await self._changed.wait_for(predicate)

    def drop_connections(self) -> None:
        for session in self.sessions:
            session.writer.transport.abort()
        self.sessions.clear()
        self.flow_ids.clear()

    def fail_connections(self, code: str) -> None:
        """A connection-level ERROR (id 0), after which the gateway closes."""
        for peer in self.sessions:
            peer.send(Error(code=code, text="going away"))
            peer.writer.close()
        self.sessions.clear()
        self.flow_ids.clear()

    def release_close(self) -> None:
        """Answer the CLOSEs held (``hold_close``) and close those connections."""
        self.hold_close = False
        for peer in self._closing:
            self._close(peer)
        self._closing.clear()

    def _close(self, peer: Peer) -> None:
        peer.send(Close(reason="client closing"))
        peer.writer.close()

    def deliver(self, flow_id: str, seq: int, payload: bytes = b"x", **fields: object) -> Deliver:
        event = Deliver(
            flow_id=flow_id,
            message_id=f"{flow_id}-m{seq}",
            partition=seq % 2,
            seq=seq,
            key=None,
            payload=payload,
            **fields,  # type: ignore[arg-type]
        )
        self.flow_ids[flow_id].send(event)
        return event

    def change_partitions(self, flow_id: str, partitions: frozenset[int]) -> None:
        self.flow_ids[flow_id].send(PartitionsChanged(flow_id=flow_id, partitions=partitions))

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        session = Peer(ServerConnection(), writer)
        self.sessions.append(session)
        try:
            while data := await reader.read(65536):
                session.conn.receive_data(data)
                while (event := session.conn.next_event()) is not None:
                    self.received.append(event)
                    self._answer(session, event)
                    async with self._changed:
                        self._changed.notify_all()
        except (NativeProtocolError, ConnectionError):
            writer.transport.abort()
        finally:
            writer.close()

    def _answer(self, s: Peer, event: Event) -> None:
        match event:
            case Hello():
                if self.password is not None and event.password != self.password:
                    s.send(
                        Error(request_id=event.request_id, code="authentication-failed", text="no")
                    )
                    s.send(Close(reason="auth"))
                else:
                    s.send(s.conn.accept("fake", f"session-{next(self._ids)}"))
            case Publish(queue=queue) if queue is not None and queue not in self.queues:
                s.send(
                    Error(request_id=event.request_id, code="queue-not-found", text=f"no {queue}")
                )
            case Publish():
                if not self.hold_publishes:
                    s.send(
                        PublishOk(
                            request_id=event.request_id, message_ids=(f"id-{event.request_id}",)
                        )
                    )
            case DeclareQueue():
                self.queues[event.name] = int(event.settings.get("partitions", 0))
                s.send(
                    QueueOk(
                        request_id=event.request_id,
                        name=event.name,
                        settings=event.settings,
                        subscriptions=event.subscriptions or (),
                    )
                )
            case DeleteQueue():
                if self.queues.pop(event.name, None) is None:
                    s.send(Error(request_id=event.request_id, code="queue-not-found", text="gone"))
                else:
                    s.send(Ok(request_id=event.request_id))
            case Bind():
                flow_id = f"flow-{next(self._ids)}"
                self.flow_ids[flow_id] = s
                s.send(
                    BindOk(
                        request_id=event.request_id,
                        flow_id=flow_id,
                        partitions=self.partitions_for_bind(event),
                        mode=event.mode or GroupMode.PARTITIONED,
                        window=event.window or 10_000,
                    )
                )
            case Unbind():
                s.send(Ok(request_id=event.request_id))
            case Ping():
                if self.answer_pings:
                    s.send(Pong(request_id=event.request_id))
            case Close():
                if self.hold_close:
                    self._closing.append(s)
                else:
                    self._close(s)
            case _:
                pass
