"""AMQP timestamps read as the integers they are: the ``timestamp`` basic property and
field-table values of type 'T'.

Why: pamqp decodes a timestamp into a datetime, takes any value above 2^32 - 1 for
milliseconds (divided by 1000: a publisher's ``now * 1000`` came back as ``now``), and
raises from year 10000 on (2^62 closed the publisher's connection as a malformed frame).
On the wire a timestamp is an unsigned 64-bit integer, which RabbitMQ stores and delivers
unchanged whatever a client puts in it (seconds, milliseconds...). So keygate reads it as
``Timestamp``, an int that remembers it was a timestamp, and writes a ``Timestamp`` back
as one (codec.py). ``field_table`` and ``field_array`` are pamqp's ``decode.field_table``
and ``decode.field_array`` with that one change, reading every other value type with
pamqp's own decoders (``decode.TABLE_MAPPING``); hotframes.py uses them for the content
header of a publish, and tests/unit/protocols/test_amqp_hotframes.py checks them against
pamqp with its timestamp decoder replaced by ``timestamp``.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any, Final

from pamqp import decode

_U64: Final = struct.Struct(">Q")
_U32: Final = struct.Struct(">I")


class Timestamp(int):
    """An AMQP timestamp: its raw unsigned 64-bit value."""

    __slots__ = ()

    def __repr__(self) -> str:
        return f"Timestamp({int(self)})"

    def __str__(self) -> str:
        return int.__repr__(self)


def encode_timestamp(value: int) -> bytes:
    """The 8 bytes of a timestamp (struct.error outside 0 .. 2^64 - 1)."""
    return _U64.pack(value)


def timestamp(value: bytes) -> tuple[int, Timestamp]:
    """A timestamp at the start of ``value``: bytes consumed and the value."""
    try:
        return 8, Timestamp(_U64.unpack_from(value)[0])
    except struct.error as e:
        raise ValueError("Could not unpack timestamp value") from e


def _embedded_value(value: bytes) -> tuple[int, Any]:
    """pamqp's ``decode.embedded_value`` with this module's timestamps, tables and arrays."""
    if not value:
        return 0, None
    kind = value[0:1]
    decoder = _DECODERS.get(kind) or decode.TABLE_MAPPING.get(kind)
    if decoder is None:
        raise ValueError(f"Unknown type: {kind!r}")
    consumed, result = decoder(value[1:])
    return consumed + 1, result


def field_array(value: bytes) -> tuple[int, list[Any]]:
    """A field array at the start of ``value``: bytes consumed and the values."""
    try:
        end = 4 + _U32.unpack_from(value)[0]
        if end > len(value):
            raise ValueError("Field array length exceeds available data")
        offset = 4
        data = []
        while offset < end:
            consumed, result = _embedded_value(value[offset:])
            offset += consumed
            data.append(result)
        return offset, data
    except (struct.error, TypeError) as e:
        raise ValueError("Could not unpack data") from e


def field_table(value: bytes) -> tuple[int, dict[str, Any]]:
    """A field table at the start of ``value``: bytes consumed and the table."""
    try:
        end = 4 + _U32.unpack_from(value)[0]
        if end > len(value):
            raise ValueError("Field table length exceeds available data")
        offset = 4
        data = {}
        while offset < end:
            key_length = value[offset]
            offset += 1
            if offset + key_length > end:
                raise ValueError("Field table key length exceeds data")
            key = value[offset : offset + key_length].decode("utf-8")
            offset += key_length
            consumed, result = _embedded_value(value[offset:])
            offset += consumed
            data[key] = result
        return end, data
    except (struct.error, TypeError, IndexError) as e:
        raise ValueError("Could not unpack data") from e


_DECODERS: Final[dict[bytes, Callable[[bytes], tuple[int, Any]]]] = {
    b"T": timestamp,
    b"F": field_table,
    b"A": field_array,
}

__all__ = ["Timestamp", "encode_timestamp", "field_array", "field_table", "timestamp"]
