"""A hand-driven client of the sans-IO ``AmqpConnection``, shared by its unit tests."""

from __future__ import annotations

from typing import Any

from pamqp import base, commands, frame

from protocols.amqp import events as ev
from protocols.amqp.codec import FrameReader, content_frames
from protocols.amqp.connection import AmqpConnection, State
from protocols.amqp.constants import PROTOCOL_HEADER
from protocols.amqp.exchanges import Exchanges

PLAIN = "\x00guest\x00guest"


class Client:
    """Drives an AmqpConnection with client frames and decodes what it answers."""

    def __init__(
        self, max_message_size: int = 1_000_000, max_unconfirmed_bytes: int = 16 << 20
    ) -> None:
        self.conn = AmqpConnection(
            Exchanges(),
            frame_max=8192,
            channel_max=16,
            heartbeat=30,
            max_message_size=max_message_size,
            max_unconfirmed_bytes=max_unconfirmed_bytes,
        )
        self._reader = FrameReader(1 << 20)
        self._reader.feed(PROTOCOL_HEADER)
        self.events: list[ev.Event] = []

    def send(self, data: bytes) -> list[Any]:
        self.conn.receive_data(data)
        while (event := self.conn.next_event()) is not None:
            self.events.append(event)
        return self.replies()

    def method(self, channel: int, method: base.Frame) -> list[Any]:
        return self.send(frame.marshal(method, channel))

    def replies(self) -> list[Any]:
        self._reader.feed(self.conn.data_to_send())
        frames = []
        while (item := self._reader.next_frame()) is not None:
            frames.append(item)
        return frames

    def take(self) -> list[ev.Event]:
        events, self.events = self.events, []
        return events

    def open(self) -> None:
        [start] = self.send(PROTOCOL_HEADER)
        assert isinstance(start.payload, commands.Connection.Start)
        capabilities: Any = {"connection.blocked": True}
        self.method(0, commands.Connection.StartOk({"capabilities": capabilities}, "PLAIN", PLAIN))
        [auth] = self.take()
        assert isinstance(auth, ev.Authenticate) and auth.username == "guest"
        self.conn.authenticated(None, admin=True)
        [tune] = self.replies()
        assert isinstance(tune.payload, commands.Connection.Tune)
        self.method(0, commands.Connection.TuneOk(16, 8192, 30))
        [open_ok] = self.method(0, commands.Connection.Open("/"))
        assert isinstance(open_ok.payload, commands.Connection.OpenOk)
        assert self.conn.state is State.OPEN

    def channel(self, number: int = 1, confirm: bool = False) -> None:
        [ok] = self.method(number, commands.Channel.Open())
        assert isinstance(ok.payload, commands.Channel.OpenOk)
        if confirm:
            [ok] = self.method(number, commands.Confirm.Select())
            assert isinstance(ok.payload, commands.Confirm.SelectOk)

    def publish(
        self, payload: bytes, *, channel: int = 1, exchange: str = "", key: str = "q", **kw: Any
    ) -> list[Any]:
        props = commands.Basic.Properties(**kw)
        method = commands.Basic.Publish(exchange=exchange, routing_key=key)
        data = frame.marshal(method, channel) + content_frames(channel, props, payload, 8192)
        return self.send(data)


__all__ = ["PLAIN", "Client"]
