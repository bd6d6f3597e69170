"""Decoding: one complete frame body in, one event out.

``decode_frame`` gets the frame type, request id and the body (everything after the
9-byte header) and reads the fields in the order docs/native-protocol.md lists them.
Anything malformed — a field running past the body, bytes left over after the last field,
an unknown type tag or enum code, invalid UTF-8 — raises ``NativeProtocolError``; nothing
else escapes.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any, Final

from core.frozen import bare
from core.model import PropertyValue
from protocols.native.encoding import (
    F64,
    I64,
    PARTITION_SEQ,
    TAG_BOOL,
    TAG_BYTES,
    TAG_FLOAT,
    TAG_INT,
    TAG_STR,
    U16,
    U32,
)
from protocols.native.errors import NativeProtocolError
from protocols.native.events import (
    ACK_MODE_CODES,
    GROUP_MODE_CODES,
    KEY_ORDER_CODES,
    START_CODES,
    Ack,
    AckCumulative,
    Bind,
    BindOk,
    Close,
    Credit,
    DeclareQueue,
    DeleteQueue,
    Deliver,
    Error,
    Event,
    FlowClosed,
    FrameType,
    Hello,
    HelloOk,
    Nack,
    NackOutcome,
    Ok,
    PartitionsChanged,
    Ping,
    Pong,
    Publish,
    PublishOk,
    QueueOk,
    Unbind,
)

# A PUBLISH's end when it has no properties and none of the optional fields after them.
_NO_PROPERTIES_NOTHING_ELSE: Final = bytes(8)


class _Reader:
    """Cursor over one frame body. Every read checks bounds and raises on truncation."""

    __slots__ = ("data", "end", "pos")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.pos = 0
        self.end = len(data)

    def _take(self, n: int) -> int:
        pos = self.pos
        if pos + n > self.end:
            raise NativeProtocolError("frame truncated: a field runs past the frame's end")
        self.pos = pos + n
        return pos

    def u8(self) -> int:
        pos = self.pos
        if pos >= self.end:
            raise NativeProtocolError("frame truncated: a field runs past the frame's end")
        self.pos = pos + 1
        return self.data[pos]

    def flag(self) -> bool:
        pos = self.pos
        if pos >= self.end:
            raise NativeProtocolError("frame truncated: a field runs past the frame's end")
        self.pos = pos + 1
        value = self.data[pos]
        if value > 1:
            raise NativeProtocolError(f"flag byte must be 0 or 1, got {value}")
        return value == 1

    def u16(self) -> int:
        return int(U16.unpack_from(self.data, self._take(2))[0])

    def u32(self) -> int:
        return int(U32.unpack_from(self.data, self._take(4))[0])

    def f64(self) -> float:
        return float(F64.unpack_from(self.data, self._take(8))[0])

    def partition_seq(self) -> tuple[int, int]:
        partition, seq = PARTITION_SEQ.unpack_from(self.data, self._take(12))
        return int(partition), int(seq)

    def text(self) -> str:
        # Inlined bounds checks: strings are most of a DELIVER's fields.
        data, start = self.data, self.pos + 2
        if start > self.end:
            raise NativeProtocolError("frame truncated: a field runs past the frame's end")
        stop = start + ((data[start - 2] << 8) | data[start - 1])
        if stop > self.end:
            raise NativeProtocolError("frame truncated: a field runs past the frame's end")
        self.pos = stop
        try:
            return data[start:stop].decode()
        except UnicodeDecodeError as e:
            raise NativeProtocolError(f"invalid UTF-8 in a string field: {e}") from e

    def blob(self) -> bytes:
        n = self.u32()
        pos = self._take(n)
        return self.data[pos : pos + n]

    # An absent optional field is read without a call: most of a PUBLISH's or DELIVER's
    # optional fields are absent, and each is read once per message.
    def opt_str(self) -> str | None:
        pos = self.pos
        if pos < self.end and self.data[pos] == 0:
            self.pos = pos + 1
            return None
        return self.text() if self.flag() else None

    def opt_f64(self) -> float | None:
        pos = self.pos
        if pos < self.end and self.data[pos] == 0:
            self.pos = pos + 1
            return None
        return self.f64() if self.flag() else None

    def str_list(self) -> tuple[str, ...]:
        count = self.u32()
        # Each string needs at least its 2-byte length: bound the count before looping.
        if count * 2 > self.end - self.pos:
            raise NativeProtocolError("string list count exceeds the frame")
        return tuple(self.text() for _ in range(count))

    def u32_set(self) -> frozenset[int]:
        count = self.u32()
        pos = self._take(count * 4)
        return frozenset(struct.unpack_from(f">{count}I", self.data, pos))

    def properties(self) -> dict[str, PropertyValue]:
        count = self.u16()
        props: dict[str, PropertyValue] = {}
        for _ in range(count):
            key = self.text()
            tag = self.u8()
            value: PropertyValue
            if tag == TAG_STR:
                value = self.text()
            elif tag == TAG_INT:
                value = int(I64.unpack_from(self.data, self._take(8))[0])
            elif tag == TAG_FLOAT:
                value = self.f64()
            elif tag == TAG_BOOL:
                value = self.flag()
            elif tag == TAG_BYTES:
                value = self.blob()
            else:
                raise NativeProtocolError(f"unknown property type tag {tag} for {key!r}")
            props[key] = value
        return props

    def opt_tags(self) -> dict[str, str] | None:
        if not self.flag():
            return None
        return {self.text(): self.text() for _ in range(self.u16())}

    def code(self, codes: tuple[Any, ...], what: str) -> Any:
        value = self.u8()
        if value >= len(codes):
            raise NativeProtocolError(f"unknown {what} code {value}")
        return codes[value]

    def opt_code(self, codes: tuple[Any, ...], what: str) -> Any:
        return self.code(codes, what) if self.flag() else None


def _r_hello(r: _Reader, rid: int) -> Hello:
    return Hello(
        request_id=rid,
        version=r.u16(),
        client_name=r.text(),
        username=r.opt_str(),
        password=r.opt_str(),
        max_frame=r.u32(),
    )


def _r_hello_ok(r: _Reader, rid: int) -> HelloOk:
    return HelloOk(
        request_id=rid,
        version=r.u16(),
        server_name=r.text(),
        session_id=r.text(),
        max_frame=r.u32(),
    )


def _r_publish(r: _Reader, rid: int) -> Publish:
    # The frame that comes by the thousand. Its usual shape is read without a call per
    # field: no properties (a zero count), and none of the six optional fields after them
    # (six zero flag bytes ending the frame, which can be read no other way).
    queue = r.opt_str()
    topic = r.opt_str()
    key = r.opt_str()
    payload = r.blob()
    data, pos, end = r.data, r.pos, r.end
    if pos + 8 == end and data.endswith(_NO_PROPERTIES_NOTHING_ELSE):
        r.pos = end
        properties: dict[str, PropertyValue] = {}
        ttl = deliver_at = None
        dedup_id = content_type = correlation_id = reply_to = None
    else:
        properties = r.properties()
        ttl = r.opt_f64()
        deliver_at = r.opt_f64()
        dedup_id = r.opt_str()
        content_type = r.opt_str()
        correlation_id = r.opt_str()
        reply_to = r.opt_str()
    event = bare(Publish)  # core.frozen: keywords without a dict of them
    Publish.__init__(
        event,
        request_id=rid,
        queue=queue,
        topic=topic,
        key=key,
        payload=payload,
        properties=properties,
        ttl=ttl,
        deliver_at=deliver_at,
        dedup_id=dedup_id,
        content_type=content_type,
        correlation_id=correlation_id,
        reply_to=reply_to,
    )
    return event


def _r_publish_ok(r: _Reader, rid: int) -> PublishOk:
    return PublishOk(request_id=rid, message_ids=r.str_list(), duplicate=r.flag())


def _r_bind(r: _Reader, rid: int) -> Bind:
    return Bind(
        request_id=rid,
        queue=r.text(),
        group=r.text(),
        window=r.u32(),
        ack_mode=r.code(ACK_MODE_CODES, "ack mode"),
        tags=r.opt_tags(),
        mode=r.opt_code(GROUP_MODE_CODES, "group mode"),
        key_order=r.opt_code(KEY_ORDER_CODES, "key order"),
        start=r.opt_code(START_CODES, "start position"),
        ack_timeout=r.opt_f64(),
        previous_partitions=r.u32_set() if r.flag() else None,
    )


def _r_bind_ok(r: _Reader, rid: int) -> BindOk:
    return BindOk(
        request_id=rid,
        flow_id=r.text(),
        partitions=r.u32_set(),
        mode=r.code(GROUP_MODE_CODES, "group mode"),
        window=r.u32(),
    )


def _r_deliver(r: _Reader, rid: int) -> Deliver:
    flow_id = r.text()
    message_id = r.text()
    partition, seq = r.partition_seq()
    return Deliver(
        request_id=rid,
        flow_id=flow_id,
        message_id=message_id,
        partition=partition,
        seq=seq,
        key=r.opt_str(),
        payload=r.blob(),
        properties=r.properties(),
        topic=r.opt_str(),
        publish_time=r.f64(),
        delivery_count=r.u32(),
        redelivered=r.flag(),
        content_type=r.opt_str(),
        correlation_id=r.opt_str(),
        reply_to=r.opt_str(),
    )


def _r_ack(r: _Reader, rid: int) -> Ack:
    return Ack(request_id=rid, flow_id=r.text(), message_ids=r.str_list())


def _r_ack_cumulative(r: _Reader, rid: int) -> AckCumulative:
    flow_id = r.text()
    partition, seq = r.partition_seq()
    return AckCumulative(request_id=rid, flow_id=flow_id, partition=partition, seq=seq)


def _r_nack(r: _Reader, rid: int) -> Nack:
    return Nack(
        request_id=rid,
        flow_id=r.text(),
        message_ids=r.str_list(),
        outcome=r.code(tuple(NackOutcome), "nack outcome"),
        delay=r.opt_f64(),
    )


def _r_credit(r: _Reader, rid: int) -> Credit:
    return Credit(request_id=rid, flow_id=r.text(), window=r.u32())


def _r_partitions_changed(r: _Reader, rid: int) -> PartitionsChanged:
    return PartitionsChanged(request_id=rid, flow_id=r.text(), partitions=r.u32_set())


def _r_flow_closed(r: _Reader, rid: int) -> FlowClosed:
    return FlowClosed(request_id=rid, flow_id=r.text(), code=r.text(), text=r.text())


def _r_unbind(r: _Reader, rid: int) -> Unbind:
    return Unbind(request_id=rid, flow_id=r.text(), shutdown=r.flag())


def _r_declare_queue(r: _Reader, rid: int) -> DeclareQueue:
    return DeclareQueue(
        request_id=rid,
        name=r.text(),
        settings=r.properties(),
        subscriptions=r.str_list() if r.flag() else None,
        exist_ok=r.flag(),
        passive=r.flag(),
    )


def _r_queue_ok(r: _Reader, rid: int) -> QueueOk:
    return QueueOk(
        request_id=rid, name=r.text(), settings=r.properties(), subscriptions=r.str_list()
    )


def _r_delete_queue(r: _Reader, rid: int) -> DeleteQueue:
    return DeleteQueue(request_id=rid, name=r.text())


def _r_ok(r: _Reader, rid: int) -> Ok:
    return Ok(request_id=rid)


def _r_ping(r: _Reader, rid: int) -> Ping:
    return Ping(request_id=rid)


def _r_pong(r: _Reader, rid: int) -> Pong:
    return Pong(request_id=rid)


def _r_error(r: _Reader, rid: int) -> Error:
    return Error(request_id=rid, code=r.text(), text=r.text())


def _r_close(r: _Reader, rid: int) -> Close:
    return Close(request_id=rid, reason=r.text())


_READERS: Final[dict[int, Callable[[_Reader, int], Event]]] = {
    FrameType.HELLO: _r_hello,
    FrameType.HELLO_OK: _r_hello_ok,
    FrameType.PUBLISH: _r_publish,
    FrameType.PUBLISH_OK: _r_publish_ok,
    FrameType.BIND: _r_bind,
    FrameType.BIND_OK: _r_bind_ok,
    FrameType.DELIVER: _r_deliver,
    FrameType.ACK: _r_ack,
    FrameType.ACK_CUMULATIVE: _r_ack_cumulative,
    FrameType.NACK: _r_nack,
    FrameType.CREDIT: _r_credit,
    FrameType.PARTITIONS_CHANGED: _r_partitions_changed,
    FrameType.FLOW_CLOSED: _r_flow_closed,
    FrameType.UNBIND: _r_unbind,
    FrameType.OK: _r_ok,
    FrameType.DECLARE_QUEUE: _r_declare_queue,
    FrameType.QUEUE_OK: _r_queue_ok,
    FrameType.DELETE_QUEUE: _r_delete_queue,
    FrameType.PING: _r_ping,
    FrameType.PONG: _r_pong,
    FrameType.ERROR: _r_error,
    FrameType.CLOSE: _r_close,
}


def decode_frame(frame_type: int, request_id: int, body: bytes) -> Event:
    """Parse one frame body. Raises NativeProtocolError for anything malformed."""
    reader_fn = _READERS.get(frame_type)
    if reader_fn is None:
        raise NativeProtocolError(f"unknown frame type 0x{frame_type:02x}")
    reader = _Reader(body)
    event = reader_fn(reader, request_id)
    if reader.pos != reader.end:
        raise NativeProtocolError(
            f"{type(event).__name__} frame has {reader.end - reader.pos} unexpected trailing bytes"
        )
    return event
