"""Encoding: events in, frame bytes out.

A frame is ``u32 length`` (big-endian, of everything after it) + ``u8 type`` +
``u32 request id`` + the frame's fields in a fixed order (docs/native-protocol.md). Each
writer appends its fields to one bytearray with precompiled ``struct.Struct`` packers; the
header is packed into the reserved first nine bytes at the end, once the length is known.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Final, Protocol

from core.errors import InvalidArgument
from core.model import PropertyValue
from protocols.native.errors import FrameTooLarge
from protocols.native.events import (
    ACK_MODE_CODES,
    DEFAULT_MAX_FRAME,
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
    Ok,
    PartitionsChanged,
    Ping,
    Pong,
    Publish,
    PublishOk,
    QueueOk,
    Unbind,
)

HEADER: Final = struct.Struct(">IBI")
U16: Final = struct.Struct(">H")
U32: Final = struct.Struct(">I")
PARTITION_SEQ: Final = struct.Struct(">IQ")
I64: Final = struct.Struct(">q")
F64: Final = struct.Struct(">d")
# DELIVER's fixed-size runs of fields, each packed at once: partition, seq and the key's
# presence flag; publish time, delivery count and redelivered flag, alone or followed by
# three absent optional strings (content type, correlation id, reply-to).
_PARTITION_SEQ_FLAG: Final = struct.Struct(">IQB")
_TIME_COUNT_FLAG: Final = struct.Struct(">dIB")
_TIME_COUNT_FLAG_THREE_ABSENT: Final = struct.Struct(">dIBxxx")
_NO_PROPERTIES_NO_TOPIC: Final = b"\x00\x00\x00"
_HEADER_SPACE: Final = bytes(HEADER.size)
HEADER_SIZE: Final = HEADER.size  # 9: length + type + request id

# Property value type tags.
TAG_STR: Final = 1
TAG_INT: Final = 2
TAG_FLOAT: Final = 3
TAG_BOOL: Final = 4
TAG_BYTES: Final = 5


# --------------------------------------------------------------------------- writing


def _str(out: bytearray, value: str) -> None:
    data = value.encode()
    if len(data) > 0xFFFF:
        raise InvalidArgument(f"string field longer than 65535 bytes: {value[:40]!r}...")
    out += U16.pack(len(data))
    out += data


def _opt_str(out: bytearray, value: str | None) -> None:
    if value is None:
        out.append(0)
    else:
        out.append(1)
        _str(out, value)


def _bytes(out: bytearray, value: bytes) -> None:
    out += U32.pack(len(value))
    out += value


def _opt_f64(out: bytearray, value: float | None) -> None:
    if value is None:
        out.append(0)
    else:
        out.append(1)
        out += F64.pack(value)


def _str_list(out: bytearray, values: Iterable[str]) -> None:
    items = list(values)
    out += U32.pack(len(items))
    for item in items:
        _str(out, item)


def _u32_list(out: bytearray, values: Iterable[int]) -> None:
    items = sorted(values)
    out += U32.pack(len(items))
    out += struct.pack(f">{len(items)}I", *items)


def _properties(out: bytearray, props: Mapping[str, PropertyValue]) -> None:
    if len(props) > 0xFFFF:
        raise InvalidArgument("more than 65535 properties")
    out += U16.pack(len(props))
    for key, value in props.items():
        _str(out, key)
        # bool before int: bool is an int subclass.
        if isinstance(value, bool):
            out.append(TAG_BOOL)
            out.append(1 if value else 0)
        elif isinstance(value, int):
            if not -(2**63) <= value < 2**63:
                raise InvalidArgument(f"property {key!r}: int out of the i64 range")
            out.append(TAG_INT)
            out += I64.pack(value)
        elif isinstance(value, float):
            out.append(TAG_FLOAT)
            out += F64.pack(value)
        elif isinstance(value, str):
            out.append(TAG_STR)
            _str(out, value)
        elif isinstance(value, bytes | bytearray | memoryview):
            out.append(TAG_BYTES)
            _bytes(out, bytes(value))
        else:
            raise InvalidArgument(f"property {key!r}: unsupported type {type(value).__name__}")


def _opt_tags(out: bytearray, tags: Mapping[str, str] | None) -> None:
    if tags is None:
        out.append(0)
        return
    out.append(1)
    out += U16.pack(len(tags))
    for key, value in tags.items():
        _str(out, key)
        _str(out, value)


def _opt_code(out: bytearray, codes: tuple[Any, ...], value: Any) -> None:
    if value is None:
        out.append(0)
    else:
        out.append(1)
        out.append(codes.index(value))


def _w_hello(out: bytearray, e: Hello) -> None:
    out += U16.pack(e.version)
    _str(out, e.client_name)
    _opt_str(out, e.username)
    _opt_str(out, e.password)
    out += U32.pack(e.max_frame)


def _w_hello_ok(out: bytearray, e: HelloOk) -> None:
    out += U16.pack(e.version)
    _str(out, e.server_name)
    _str(out, e.session_id)
    out += U32.pack(e.max_frame)


def _w_publish(out: bytearray, e: Publish) -> None:
    _opt_str(out, e.queue)
    _opt_str(out, e.topic)
    _opt_str(out, e.key)
    _bytes(out, e.payload)
    _properties(out, e.properties)
    _opt_f64(out, e.ttl)
    _opt_f64(out, e.deliver_at)
    _opt_str(out, e.dedup_id)
    _opt_str(out, e.content_type)
    _opt_str(out, e.correlation_id)
    _opt_str(out, e.reply_to)


def _publish_ok_fields(out: bytearray, message_ids: Sequence[str], duplicate: bool) -> None:
    _str_list(out, message_ids)
    out.append(1 if duplicate else 0)


def _w_publish_ok(out: bytearray, e: PublishOk) -> None:
    _publish_ok_fields(out, e.message_ids, e.duplicate)


def _w_bind(out: bytearray, e: Bind) -> None:
    _str(out, e.queue)
    _str(out, e.group)
    out += U32.pack(e.window)
    out.append(ACK_MODE_CODES.index(e.ack_mode))
    _opt_tags(out, e.tags)
    _opt_code(out, GROUP_MODE_CODES, e.mode)
    _opt_code(out, KEY_ORDER_CODES, e.key_order)
    _opt_code(out, START_CODES, e.start)
    _opt_f64(out, e.ack_timeout)
    if e.previous_partitions is None:
        out.append(0)
    else:
        out.append(1)
        _u32_list(out, e.previous_partitions)


def _w_bind_ok(out: bytearray, e: BindOk) -> None:
    _str(out, e.flow_id)
    _u32_list(out, e.partitions)
    out.append(GROUP_MODE_CODES.index(e.mode))
    out += U32.pack(e.window)


class DeliveredMessage(Protocol):
    """What a DELIVER carries of a message: a ``Deliver`` event has these fields, and so
    has ``core.model.Message``, which the gateway writes from without making an event."""

    @property
    def message_id(self) -> str: ...
    @property
    def partition(self) -> int: ...
    @property
    def seq(self) -> int: ...
    @property
    def key(self) -> str | None: ...
    @property
    def payload(self) -> bytes: ...
    @property
    def properties(self) -> Mapping[str, PropertyValue]: ...
    @property
    def topic(self) -> str | None: ...
    @property
    def publish_time(self) -> float: ...
    @property
    def content_type(self) -> str | None: ...
    @property
    def correlation_id(self) -> str | None: ...
    @property
    def reply_to(self) -> str | None: ...


def _deliver_fields(
    out: bytearray, flow_id: str, m: DeliveredMessage, delivery_count: int, redelivered: bool
) -> None:
    # Every delivery is written here (an auto-ack one twice when its socket was slow), so
    # the fixed-size runs of fields are packed together, and the fields most messages
    # leave empty are written as their absent forms at once.
    _str(out, flow_id)
    _str(out, m.message_id)
    key = m.key
    if key is None:
        out += _PARTITION_SEQ_FLAG.pack(m.partition, m.seq, 0)
    else:
        out += _PARTITION_SEQ_FLAG.pack(m.partition, m.seq, 1)
        _str(out, key)
    payload = m.payload
    out += U32.pack(len(payload))
    out += payload
    properties, topic = m.properties, m.topic
    if not properties and topic is None:
        out += _NO_PROPERTIES_NO_TOPIC
    else:
        _properties(out, properties)
        _opt_str(out, topic)
    flag = 1 if redelivered else 0
    if m.content_type is None and m.correlation_id is None and m.reply_to is None:
        out += _TIME_COUNT_FLAG_THREE_ABSENT.pack(m.publish_time, delivery_count, flag)
    else:
        out += _TIME_COUNT_FLAG.pack(m.publish_time, delivery_count, flag)
        _opt_str(out, m.content_type)
        _opt_str(out, m.correlation_id)
        _opt_str(out, m.reply_to)


def _w_deliver(out: bytearray, e: Deliver) -> None:
    _deliver_fields(out, e.flow_id, e, e.delivery_count, e.redelivered)


def _w_ack(out: bytearray, e: Ack) -> None:
    _str(out, e.flow_id)
    _str_list(out, e.message_ids)


def _w_ack_cumulative(out: bytearray, e: AckCumulative) -> None:
    _str(out, e.flow_id)
    out += PARTITION_SEQ.pack(e.partition, e.seq)


def _w_nack(out: bytearray, e: Nack) -> None:
    _str(out, e.flow_id)
    _str_list(out, e.message_ids)
    out.append(int(e.outcome))
    _opt_f64(out, e.delay)


def _w_credit(out: bytearray, e: Credit) -> None:
    _str(out, e.flow_id)
    out += U32.pack(e.window)


def _w_partitions_changed(out: bytearray, e: PartitionsChanged) -> None:
    _str(out, e.flow_id)
    _u32_list(out, e.partitions)


def _w_flow_closed(out: bytearray, e: FlowClosed) -> None:
    _str(out, e.flow_id)
    _str(out, e.code)
    _str(out, e.text)


def _w_unbind(out: bytearray, e: Unbind) -> None:
    _str(out, e.flow_id)
    out.append(1 if e.shutdown else 0)


def _w_declare_queue(out: bytearray, e: DeclareQueue) -> None:
    _str(out, e.name)
    _properties(out, e.settings)
    if e.subscriptions is None:
        out.append(0)
    else:
        out.append(1)
        _str_list(out, e.subscriptions)
    out.append(1 if e.exist_ok else 0)
    out.append(1 if e.passive else 0)


def _w_queue_ok(out: bytearray, e: QueueOk) -> None:
    _str(out, e.name)
    _properties(out, e.settings)
    _str_list(out, e.subscriptions)


def _w_name(out: bytearray, e: DeleteQueue) -> None:
    _str(out, e.name)


def _w_empty(out: bytearray, e: Ok | Ping | Pong) -> None:
    return


def _w_error(out: bytearray, e: Error) -> None:
    _str(out, e.code)
    _str(out, e.text)


def _w_close(out: bytearray, e: Close) -> None:
    _str(out, e.reason)


_WRITERS: Final[dict[type[Any], tuple[int, Callable[[bytearray, Any], None]]]] = {
    Hello: (FrameType.HELLO, _w_hello),
    HelloOk: (FrameType.HELLO_OK, _w_hello_ok),
    Publish: (FrameType.PUBLISH, _w_publish),
    PublishOk: (FrameType.PUBLISH_OK, _w_publish_ok),
    Bind: (FrameType.BIND, _w_bind),
    BindOk: (FrameType.BIND_OK, _w_bind_ok),
    Deliver: (FrameType.DELIVER, _w_deliver),
    Ack: (FrameType.ACK, _w_ack),
    AckCumulative: (FrameType.ACK_CUMULATIVE, _w_ack_cumulative),
    Nack: (FrameType.NACK, _w_nack),
    Credit: (FrameType.CREDIT, _w_credit),
    PartitionsChanged: (FrameType.PARTITIONS_CHANGED, _w_partitions_changed),
    FlowClosed: (FrameType.FLOW_CLOSED, _w_flow_closed),
    Unbind: (FrameType.UNBIND, _w_unbind),
    Ok: (FrameType.OK, _w_empty),
    DeclareQueue: (FrameType.DECLARE_QUEUE, _w_declare_queue),
    QueueOk: (FrameType.QUEUE_OK, _w_queue_ok),
    DeleteQueue: (FrameType.DELETE_QUEUE, _w_name),
    Ping: (FrameType.PING, _w_empty),
    Pong: (FrameType.PONG, _w_empty),
    Error: (FrameType.ERROR, _w_error),
    Close: (FrameType.CLOSE, _w_close),
}


def _append_frame(
    out: bytearray,
    frame_type: int,
    request_id: int,
    name: str,
    max_frame: int,
    write: Callable[..., None],
    *fields: Any,
) -> None:
    """Append one frame, its body written by ``write(out, *fields)``, to ``out``; ``out``
    is left as it was when the frame cannot be encoded or exceeds ``max_frame``."""
    start = len(out)
    out += _HEADER_SPACE
    try:
        try:
            write(out, *fields)
            length = len(out) - start - 4
            HEADER.pack_into(out, start, length, frame_type, request_id)
        except (struct.error, ValueError, OverflowError) as e:
            # ValueError also covers tuple.index of an enum value the wire has no code for.
            raise InvalidArgument(f"cannot encode {name}: {e}") from e
        if length > max_frame:
            raise FrameTooLarge(f"{name} frame of {length} bytes > {max_frame}")
    except (InvalidArgument, FrameTooLarge):
        del out[start:]
        raise


def encode(event: Event, max_frame: int = DEFAULT_MAX_FRAME) -> bytes:
    """Serialize one event into a frame. Raises InvalidArgument for unencodable fields
    and FrameTooLarge when the frame exceeds ``max_frame``."""
    frame_type, writer = _WRITERS[type(event)]
    out = bytearray()
    _append_frame(out, frame_type, event.request_id, type(event).__name__, max_frame, writer, event)
    return bytes(out)


def append_deliver(
    out: bytearray,
    flow_id: str,
    message: DeliveredMessage,
    delivery_count: int,
    redelivered: bool,
    max_frame: int,
) -> None:
    """Append the DELIVER frame of ``message`` to ``out``: the bytes ``encode`` makes of a
    ``Deliver`` event with these fields, written without making one (the gateway writes a
    frame per delivery, in runs). Raises as ``encode`` does, leaving ``out`` unchanged."""
    _append_frame(
        out,
        FrameType.DELIVER,
        0,
        "Deliver",
        max_frame,
        _deliver_fields,
        flow_id,
        message,
        delivery_count,
        redelivered,
    )


def append_publish_ok(
    out: bytearray, request_id: int, message_ids: Sequence[str], duplicate: bool, max_frame: int
) -> None:
    """Append a PUBLISH_OK to ``out``: the bytes ``encode`` makes of a ``PublishOk`` with
    these fields, without making one (a lot's confirms go out as one write). Raises as
    ``encode`` does, leaving ``out`` unchanged."""
    _append_frame(
        out,
        FrameType.PUBLISH_OK,
        request_id,
        "PublishOk",
        max_frame,
        _publish_ok_fields,
        message_ids,
        duplicate,
    )
