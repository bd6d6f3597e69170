"""MQTT data representations (§1.5): integers, Variable Byte Integers, UTF-8 strings,
binary data, string pairs, and the MQTT 5 property block (§2.2.2).

``Reader`` walks one packet body and raises ``MalformedPacket`` on any short read or bad
value, so a truncated or lying packet can never raise anything else. Writers append to a
``bytearray``.
"""

from __future__ import annotations

import dataclasses
from enum import Enum
from typing import Final

from protocols.mqtt.errors import MalformedPacket, MqttProtocolError
from protocols.mqtt.events import NO_PROPERTIES, MqttProperties, PacketType

MAX_VBI: Final = 268_435_455


class Reader:
    """A cursor over one packet body."""

    __slots__ = ("_data", "_end", "_pos")

    def __init__(self, data: bytes | memoryview, start: int = 0, end: int | None = None) -> None:
        self._data = data
        self._pos = start
        self._end = len(data) if end is None else end

    @property
    def remaining(self) -> int:
        return self._end - self._pos

    @property
    def position(self) -> int:
        return self._pos

    def _take(self, n: int) -> bytes:
        if n > self._end - self._pos:
            raise MalformedPacket("packet ends early")
        chunk = bytes(self._data[self._pos : self._pos + n])
        self._pos += n
        return chunk

    def u8(self) -> int:
        return self._take(1)[0]

    def u16(self) -> int:
        return int.from_bytes(self._take(2), "big")

    def u32(self) -> int:
        return int.from_bytes(self._take(4), "big")

    def vbi(self) -> int:
        value = 0
        for shift in range(0, 28, 7):
            byte = self.u8()
            value |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return value
        raise MalformedPacket("variable byte integer longer than 4 bytes")

    def binary(self) -> bytes:
        return self._take(self.u16())

    def utf8(self) -> str:
        return decode_utf8(self.binary())

    def pair(self) -> tuple[str, str]:
        return self.utf8(), self.utf8()

    def rest(self) -> bytes:
        return self._take(self._end - self._pos)

    def sub(self, length: int) -> Reader:
        """A reader over the next ``length`` bytes, which this reader skips."""
        if length > self._end - self._pos:
            raise MalformedPacket("length field runs past the packet")
        inner = Reader(self._data, self._pos, self._pos + length)
        self._pos += length
        return inner

    def finish(self) -> None:
        if self._pos != self._end:
            raise MalformedPacket(f"{self._end - self._pos} unexpected bytes at end of packet")


def decode_utf8(raw: bytes) -> str:
    """An MQTT UTF-8 string: well-formed, no surrogates (Python rejects them), no U+0000."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise MalformedPacket("invalid UTF-8 string") from e
    if "\x00" in text:
        raise MalformedPacket("UTF-8 string contains U+0000")
    return text


def write_vbi(out: bytearray, value: int) -> None:
    if not 0 <= value <= MAX_VBI:
        raise ValueError(f"variable byte integer out of range: {value}")
    while True:
        byte = value & 0x7F
        value >>= 7
        out.append(byte | 0x80 if value else byte)
        if not value:
            return


def write_u16(out: bytearray, value: int) -> None:
    out += value.to_bytes(2, "big")


def write_binary(out: bytearray, value: bytes) -> None:
    if len(value) > 0xFFFF:
        raise ValueError("binary data longer than 65535 bytes")
    write_u16(out, len(value))
    out += value


def write_utf8(out: bytearray, value: str) -> None:
    write_binary(out, value.encode("utf-8"))


class Kind(Enum):
    BYTE = 1
    U16 = 2
    U32 = 4
    VBI = 5
    UTF8 = 6
    BINARY = 7
    PAIR = 8


# A pseudo packet type for the Will Properties of a CONNECT payload.
WILL: Final = 0
_P: Final = PacketType

# id -> (field name, kind, packet types that may carry it) — §2.2.2.2, table 2-4.
PROPERTY_TABLE: Final[dict[int, tuple[str, Kind, frozenset[int]]]] = {
    0x01: ("payload_format_indicator", Kind.BYTE, frozenset({_P.PUBLISH, WILL})),
    0x02: ("message_expiry_interval", Kind.U32, frozenset({_P.PUBLISH, WILL})),
    0x03: ("content_type", Kind.UTF8, frozenset({_P.PUBLISH, WILL})),
    0x08: ("response_topic", Kind.UTF8, frozenset({_P.PUBLISH, WILL})),
    0x09: ("correlation_data", Kind.BINARY, frozenset({_P.PUBLISH, WILL})),
    0x0B: ("subscription_identifiers", Kind.VBI, frozenset({_P.PUBLISH, _P.SUBSCRIBE})),
    0x11: (
        "session_expiry_interval",
        Kind.U32,
        frozenset({_P.CONNECT, _P.CONNACK, _P.DISCONNECT}),
    ),
    0x12: ("assigned_client_identifier", Kind.UTF8, frozenset({_P.CONNACK})),
    0x13: ("server_keep_alive", Kind.U16, frozenset({_P.CONNACK})),
    0x15: ("authentication_method", Kind.UTF8, frozenset({_P.CONNECT, _P.CONNACK, _P.AUTH})),
    0x16: ("authentication_data", Kind.BINARY, frozenset({_P.CONNECT, _P.CONNACK, _P.AUTH})),
    0x17: ("request_problem_information", Kind.BYTE, frozenset({_P.CONNECT})),
    0x18: ("will_delay_interval", Kind.U32, frozenset({WILL})),
    0x19: ("request_response_information", Kind.BYTE, frozenset({_P.CONNECT})),
    0x1A: ("response_information", Kind.UTF8, frozenset({_P.CONNACK})),
    0x1C: ("server_reference", Kind.UTF8, frozenset({_P.CONNACK, _P.DISCONNECT})),
    0x1F: (
        "reason_string",
        Kind.UTF8,
        frozenset(
            {
                _P.CONNACK,
                _P.PUBACK,
                _P.PUBREC,
                _P.PUBREL,
                _P.PUBCOMP,
                _P.SUBACK,
                _P.UNSUBACK,
                _P.DISCONNECT,
                _P.AUTH,
            }
        ),
    ),
    0x21: ("receive_maximum", Kind.U16, frozenset({_P.CONNECT, _P.CONNACK})),
    0x22: ("topic_alias_maximum", Kind.U16, frozenset({_P.CONNECT, _P.CONNACK})),
    0x23: ("topic_alias", Kind.U16, frozenset({_P.PUBLISH})),
    0x24: ("maximum_qos", Kind.BYTE, frozenset({_P.CONNACK})),
    0x25: ("retain_available", Kind.BYTE, frozenset({_P.CONNACK})),
    0x26: ("user_properties", Kind.PAIR, frozenset({*_P, WILL})),
    0x27: ("maximum_packet_size", Kind.U32, frozenset({_P.CONNECT, _P.CONNACK})),
    0x28: ("wildcard_subscription_available", Kind.BYTE, frozenset({_P.CONNACK})),
    0x29: ("subscription_identifier_available", Kind.BYTE, frozenset({_P.CONNACK})),
    0x2A: ("shared_subscription_available", Kind.BYTE, frozenset({_P.CONNACK})),
}
_REPEATABLE: Final = frozenset({0x0B, 0x26})
# Byte properties whose only legal values are 0 and 1.
_BOOLEAN: Final = frozenset({0x01, 0x17, 0x19, 0x25, 0x28, 0x29, 0x2A})
# Properties for which 0 is a Protocol Error (§3.1.2.11, §3.8.2.1.2).
_NON_ZERO: Final = frozenset({0x0B, 0x21, 0x27})


def _read_value(reader: Reader, kind: Kind) -> int | str | bytes | tuple[str, str]:
    match kind:
        case Kind.BYTE:
            return reader.u8()
        case Kind.U16:
            return reader.u16()
        case Kind.U32:
            return reader.u32()
        case Kind.VBI:
            return reader.vbi()
        case Kind.UTF8:
            return reader.utf8()
        case Kind.BINARY:
            return reader.binary()
        case Kind.PAIR:
            return reader.pair()


def read_properties(reader: Reader, packet_type: int) -> MqttProperties:
    """Read a property length and block; reject unknown, misplaced or repeated ones."""
    block = reader.sub(reader.vbi())
    values: dict[str, object] = {}
    repeated: dict[str, list[object]] = {}
    while block.remaining:
        prop_id = block.vbi()
        entry = PROPERTY_TABLE.get(prop_id)
        if entry is None:
            raise MalformedPacket(f"unknown property identifier 0x{prop_id:02x}")
        name, kind, allowed = entry
        if packet_type not in allowed:
            raise MalformedPacket(f"property {name} is not allowed in this packet")
        value = _read_value(block, kind)
        if prop_id in _BOOLEAN and value not in (0, 1):
            raise MqttProtocolError(f"property {name} must be 0 or 1")
        if prop_id in _NON_ZERO and value == 0:
            raise MqttProtocolError(f"property {name} must not be 0")
        if prop_id in _REPEATABLE:
            repeated.setdefault(name, []).append(value)
        elif name in values:
            raise MqttProtocolError(f"property {name} appears twice")
        else:
            values[name] = value
    for name, items in repeated.items():
        values[name] = tuple(items)
    if not values:
        return NO_PROPERTIES  # most packets carry none: no object to build
    return MqttProperties(**values)  # type: ignore[arg-type]


_BY_NAME: Final = {name: (prop_id, kind) for prop_id, (name, kind, _) in PROPERTY_TABLE.items()}


def _write_value(out: bytearray, kind: Kind, value: object) -> None:
    match kind:
        case Kind.BYTE:
            assert isinstance(value, int)
            out.append(value)
        case Kind.U16:
            assert isinstance(value, int)
            write_u16(out, value)
        case Kind.U32:
            assert isinstance(value, int)
            out += value.to_bytes(4, "big")
        case Kind.VBI:
            assert isinstance(value, int)
            write_vbi(out, value)
        case Kind.UTF8:
            assert isinstance(value, str)
            write_utf8(out, value)
        case Kind.BINARY:
            assert isinstance(value, bytes)
            write_binary(out, value)
        case Kind.PAIR:
            assert isinstance(value, tuple)
            write_utf8(out, value[0])
            write_utf8(out, value[1])


def write_properties(out: bytearray, properties: MqttProperties) -> None:
    """Append a property length and block (fields in declaration order)."""
    block = bytearray()
    for field in dataclasses.fields(properties):
        value = getattr(properties, field.name)
        if value is None or value == ():
            continue
        prop_id, kind = _BY_NAME[field.name]
        for item in value if prop_id in _REPEATABLE else (value,):
            write_vbi(block, prop_id)
            _write_value(block, kind, item)
    write_vbi(out, len(block))
    out += block
