"""The project's MQTT codec over a plain socket: a test client with exact control of what
is sent and re-sent, for cases real client libraries hide (reason codes, re-sent QoS 2)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Final

from protocols.mqtt import MQTT_5, ConnAck, Connect, MqttCodec, Packet

WAIT: Final = 10.0


class RawMqtt:
    # Every client opened, so a fixture can close what a failing test left open.
    opened: list[RawMqtt] = []

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, version: int):
        self.reader, self.writer = reader, writer
        self.codec = MqttCodec(version=version)
        self.connack = ConnAck()

    @classmethod
    async def open(cls, port: int, version: int = MQTT_5) -> RawMqtt:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        client = cls(reader, writer, version)
        cls.opened.append(client)
        return client

    @classmethod
    async def connected(cls, port: int, connect: Connect) -> RawMqtt:
        """Open, send ``connect`` and require a successful CONNACK (kept in ``connack``)."""
        client = await cls.open(port, connect.protocol_level)
        await client.send(connect)
        connack = await client.receive()
        assert isinstance(connack, ConnAck) and connack.reason_code == 0, connack
        client.connack = connack
        return client

    async def send(self, packet: Packet) -> None:
        self.writer.write(self.codec.send(packet))
        await self.writer.drain()

    async def send_together(self, *packets: Packet) -> None:
        """Send ``packets`` in one write, so the server reads them together."""
        self.writer.write(b"".join(self.codec.send(packet) for packet in packets))
        await self.writer.drain()

    async def receive(self) -> Packet | None:
        """The next packet, or None once the server closed the connection."""
        async with asyncio.timeout(WAIT):
            while (packet := self.codec.next_event()) is None:
                data = await self.reader.read(65536)
                if not data:
                    return None
                self.codec.receive_data(data)
        return packet

    def abort(self) -> None:
        self.writer.transport.abort()

    @classmethod
    async def close_all(cls) -> None:
        for client in cls.opened:
            client.writer.close()
            with contextlib.suppress(ConnectionError):
                await client.writer.wait_closed()
        cls.opened.clear()
