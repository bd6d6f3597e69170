"""A sans-IO MQTT 3.1.1 / 5.0 codec: bytes in, packets out, and packets to bytes.

``receive_data`` buffers bytes; ``next_event`` returns the next whole packet, or None
until more bytes arrive, and raises an ``MqttProtocolError`` for bad input (after which
the connection is unusable). The fixed header is checked before the body is buffered, so
a peer announcing a packet over ``max_packet_size`` is refused at once.

The protocol level is learnt from CONNECT (a server codec) or given up front (tests, a
client); it decides how the later packets are laid out.
"""

from __future__ import annotations

from typing import Final

from protocols.mqtt.errors import MalformedPacket, PacketTooLarge, UnsupportedProtocolVersion
from protocols.mqtt.events import (
    MQTT_3_1_1,
    MQTT_5,
    NO_PROPERTIES,
    Auth,
    ConnAck,
    Connect,
    Disconnect,
    MqttProperties,
    Packet,
    PacketType,
    PingReq,
    PingResp,
    PubAck,
    PubComp,
    Publish,
    PubRec,
    PubRel,
    SubAck,
    Subscribe,
    Subscription,
    UnsubAck,
    Unsubscribe,
    Will,
)
from protocols.mqtt.wire import (
    MAX_VBI,
    WILL,
    Reader,
    decode_utf8,
    read_properties,
    write_binary,
    write_properties,
    write_u16,
    write_utf8,
    write_vbi,
)

# Fixed-header flag nibbles required by §2.1.3 (PUBLISH carries its own flags).
_REQUIRED_FLAGS: Final[dict[int, int]] = {
    PacketType.PUBREL: 0b0010,
    PacketType.SUBSCRIBE: 0b0010,
    PacketType.UNSUBSCRIBE: 0b0010,
}
_ACKS: Final[dict[PacketType, type[PubAck | PubRec | PubRel | PubComp]]] = {
    PacketType.PUBACK: PubAck,
    PacketType.PUBREC: PubRec,
    PacketType.PUBREL: PubRel,
    PacketType.PUBCOMP: PubComp,
}
_ACK_KINDS: Final = {cls: kind for kind, cls in _ACKS.items()}
_PUBLISH: Final = int(PacketType.PUBLISH)  # a plain int compares faster than the enum


def _has_properties(properties: MqttProperties) -> bool:
    return properties is not NO_PROPERTIES and properties != NO_PROPERTIES


class MqttCodec:
    """Frames MQTT packets in both directions for one connection."""

    def __init__(self, *, version: int | None = None, max_packet_size: int | None = None) -> None:
        self.version = version
        self.max_packet_size = max_packet_size or MAX_VBI + 5
        self._buffer = bytearray()
        self._pos = 0

    def receive_data(self, data: bytes) -> None:
        if self._pos and self._pos == len(self._buffer):
            self._buffer.clear()
            self._pos = 0
        self._buffer += data

    def next_event(self) -> Packet | None:
        """The next complete packet, or None when more bytes are needed."""
        header = self._fixed_header()
        if header is None:
            if self._pos > 65536:
                # Consumed bytes are dropped in bulk, not per packet: O(1) per packet.
                del self._buffer[: self._pos]
                self._pos = 0
            return None
        first, start, end = header
        self._pos = end
        # Released on the way out, even on error, so the buffer can grow again.
        v5 = (self.version or MQTT_5) == MQTT_5
        with memoryview(self._buffer) as view:
            if first >> 4 == _PUBLISH:
                return _publish(first & 0x0F, view, start, end, v5)
            return self._decode(first >> 4, Reader(view, start, end), v5)

    def peek_type(self) -> int | None:
        """The next packet's type as soon as its first byte has arrived, else None."""
        return self._buffer[self._pos] >> 4 if len(self._buffer) > self._pos else None

    def _fixed_header(self) -> tuple[int, int, int] | None:
        """(first byte, body start, body end) of the next packet, None if incomplete.

        The first byte is judged on arrival: a peer announcing a long body behind an
        impossible header is refused now, not after it sent (or failed to send) the body.
        """
        buf, pos = self._buffer, self._pos
        available = len(buf) - pos
        if available < 1:
            return None
        first = buf[pos]
        kind, flags = first >> 4, first & 0x0F
        if kind != _PUBLISH and (kind == 0 or flags != _REQUIRED_FLAGS.get(kind, 0)):
            raise MalformedPacket(f"reserved flags 0x{flags:x} on packet type {kind}")
        if available < 2:
            return None
        length = 0
        for index in range(1, 5):
            if index >= available:
                return None
            byte = buf[pos + index]
            length |= (byte & 0x7F) << (7 * (index - 1))
            if not byte & 0x80:
                break
        else:
            raise MalformedPacket("remaining length longer than 4 bytes")
        header_size = index + 1
        if header_size + length > self.max_packet_size:
            raise PacketTooLarge(
                f"packet of {header_size + length} bytes exceeds the maximum of "
                f"{self.max_packet_size}"
            )
        if available < header_size + length:
            return None
        return first, pos + header_size, pos + header_size + length

    def _decode(self, kind: int, reader: Reader, v5: bool) -> Packet:
        if kind == PacketType.CONNECT:
            packet: Packet = self._connect(reader)
        else:
            packet = _decode_other(PacketType(kind), reader, v5)
        reader.finish()
        return packet

    def _connect(self, reader: Reader) -> Connect:
        name = reader.utf8()
        level = reader.u8()
        if name != "MQTT" or level not in (MQTT_3_1_1, MQTT_5):
            raise UnsupportedProtocolVersion(level)
        self.version = level
        v5 = level == MQTT_5
        connect_flags = reader.u8()
        if connect_flags & 0x01:
            raise MalformedPacket("CONNECT reserved flag is set")
        has_will = bool(connect_flags & 0x04)
        will_qos = (connect_flags >> 3) & 0x03
        will_retain = bool(connect_flags & 0x20)
        if will_qos == 3 or (not has_will and (will_qos or will_retain)):
            raise MalformedPacket("inconsistent will flags")
        has_password, has_username = bool(connect_flags & 0x40), bool(connect_flags & 0x80)
        if has_password and not has_username and not v5:
            raise MalformedPacket("password without user name")
        keep_alive = reader.u16()
        properties = read_properties(reader, PacketType.CONNECT) if v5 else NO_PROPERTIES
        client_id = reader.utf8()
        will = None
        if has_will:
            will_props = read_properties(reader, WILL) if v5 else NO_PROPERTIES
            topic = reader.utf8()
            will = Will(topic, reader.binary(), will_qos, will_retain, will_props)
        username = reader.utf8() if has_username else None
        password = reader.binary() if has_password else None
        return Connect(
            client_id,
            level,
            bool(connect_flags & 0x02),
            keep_alive,
            username,
            password,
            will,
            properties,
        )

    def send(self, packet: Packet) -> bytes:
        """Encode one packet for the wire."""
        version = packet.protocol_level if isinstance(packet, Connect) else self.version
        v5 = (version or MQTT_5) == MQTT_5
        flags = 0
        body = bytearray()
        match packet:
            case Connect():
                kind = PacketType.CONNECT
                _encode_connect(body, packet)
            case ConnAck():
                kind = PacketType.CONNACK
                body.append(int(packet.session_present))
                body.append(packet.reason_code)
                if v5:
                    write_properties(body, packet.properties)
            case Publish():
                kind = PacketType.PUBLISH
                flags = packet.dup << 3 | packet.qos << 1 | packet.retain
                write_utf8(body, packet.topic)
                if packet.qos:
                    assert packet.packet_id is not None, "QoS > 0 needs a packet id"
                    write_u16(body, packet.packet_id)
                if v5:
                    write_properties(body, packet.properties)
                body += packet.payload
            case PubAck() | PubRec() | PubRel() | PubComp():
                kind = _ACK_KINDS[type(packet)]
                flags = _REQUIRED_FLAGS.get(kind, 0)
                write_u16(body, packet.packet_id)
                has_properties = _has_properties(packet.properties)
                if v5 and (packet.reason_code or has_properties):
                    body.append(packet.reason_code)
                    if has_properties:
                        write_properties(body, packet.properties)
            case Subscribe():
                kind, flags = PacketType.SUBSCRIBE, 0b0010
                write_u16(body, packet.packet_id)
                if v5:
                    write_properties(body, packet.properties)
                for sub in packet.subscriptions:
                    write_utf8(body, sub.topic_filter)
                    body.append(
                        sub.qos
                        | sub.no_local << 2
                        | sub.retain_as_published << 3
                        | sub.retain_handling << 4
                    )
            case SubAck() | UnsubAck():
                kind = PacketType.SUBACK if isinstance(packet, SubAck) else PacketType.UNSUBACK
                write_u16(body, packet.packet_id)
                if v5:
                    write_properties(body, packet.properties)
                body += bytes(packet.reason_codes)
            case Unsubscribe():
                kind, flags = PacketType.UNSUBSCRIBE, 0b0010
                write_u16(body, packet.packet_id)
                if v5:
                    write_properties(body, packet.properties)
                for topic_filter in packet.topic_filters:
                    write_utf8(body, topic_filter)
            case PingReq():
                kind = PacketType.PINGREQ
            case PingResp():
                kind = PacketType.PINGRESP
            case Disconnect() | Auth():
                kind = PacketType.DISCONNECT if isinstance(packet, Disconnect) else PacketType.AUTH
                if v5 and (packet.reason_code or _has_properties(packet.properties)):
                    body.append(packet.reason_code)
                    write_properties(body, packet.properties)
        out = bytearray([kind << 4 | flags])
        write_vbi(out, len(body))
        return bytes(out + body)


def _encode_connect(body: bytearray, packet: Connect) -> None:
    write_utf8(body, "MQTT")
    body.append(packet.protocol_level)
    will = packet.will
    flags = (
        (packet.username is not None) << 7
        | (packet.password is not None) << 6
        | (will is not None and will.retain) << 5
        | (will.qos if will else 0) << 3
        | (will is not None) << 2
        | packet.clean_start << 1
    )
    body.append(flags)
    write_u16(body, packet.keep_alive)
    v5 = packet.protocol_level == MQTT_5
    if v5:
        write_properties(body, packet.properties)
    write_utf8(body, packet.client_id)
    if will is not None:
        if v5:
            write_properties(body, will.properties)
        write_utf8(body, will.topic)
        write_binary(body, will.payload)
    if packet.username is not None:
        write_utf8(body, packet.username)
    if packet.password is not None:
        write_binary(body, packet.password)


def _publish(flags: int, data: memoryview, start: int, end: int, v5: bool) -> Publish:
    """A PUBLISH body read straight from the buffer: PUBLISH is nearly all the traffic, and
    one without properties (the usual case) needs no ``Reader`` and no property block."""
    dup, qos, retain = bool(flags & 0x08), (flags >> 1) & 0x03, bool(flags & 0x01)
    if qos == 3:
        raise MalformedPacket("PUBLISH with QoS 3")
    if dup and qos == 0:
        raise MalformedPacket("PUBLISH with DUP set at QoS 0")
    pos = start + 2
    if pos > end or (pos := pos + (data[start] << 8 | data[start + 1])) > end:
        raise MalformedPacket("packet ends early")
    topic = decode_utf8(bytes(data[start + 2 : pos]))
    packet_id = None
    if qos:
        if pos + 2 > end:
            raise MalformedPacket("packet ends early")
        packet_id = data[pos] << 8 | data[pos + 1]
        if packet_id == 0:
            raise MalformedPacket("packet identifier 0")
        pos += 2
    properties = NO_PROPERTIES
    if v5:
        if pos < end and data[pos] == 0:
            pos += 1  # an empty property block
        else:
            reader = Reader(data, pos, end)
            properties = read_properties(reader, PacketType.PUBLISH)
            pos = reader.position
    return Publish(topic, bytes(data[pos:end]), qos, retain, dup, packet_id, properties)


def _packet_id(reader: Reader) -> int:
    packet_id = reader.u16()
    if packet_id == 0:
        raise MalformedPacket("packet identifier 0")
    return packet_id


def _reason_and_properties(
    reader: Reader, kind: PacketType, v5: bool
) -> tuple[int, MqttProperties]:
    """The optional trailer of acks, DISCONNECT and AUTH (§3.4.2.1: absent means 0)."""
    if not v5 or not reader.remaining:
        return 0, NO_PROPERTIES
    reason = reader.u8()
    properties = read_properties(reader, kind) if reader.remaining else NO_PROPERTIES
    return reason, properties


def _decode_other(kind: PacketType, reader: Reader, v5: bool) -> Packet:
    match kind:
        case PacketType.CONNACK:
            session_flags = reader.u8()
            if session_flags & 0xFE:
                raise MalformedPacket("CONNACK reserved flags set")
            reason = reader.u8()
            props = read_properties(reader, kind) if v5 else NO_PROPERTIES
            return ConnAck(bool(session_flags), reason, props)
        case PacketType.PUBACK | PacketType.PUBREC | PacketType.PUBREL | PacketType.PUBCOMP:
            packet_id = _packet_id(reader)
            reason, props = _reason_and_properties(reader, kind, v5)
            return _ACKS[kind](packet_id, reason, props)
        case PacketType.SUBSCRIBE:
            packet_id = _packet_id(reader)
            props = read_properties(reader, kind) if v5 else NO_PROPERTIES
            subs = []
            while reader.remaining:
                topic_filter = reader.utf8()
                options = reader.u8()
                # 3.1.1 allows only the QoS bits; 5.0 reserves the top two (§3.8.3.1).
                if options & (0xC0 if v5 else 0xFC) or options & 0x03 == 3:
                    raise MalformedPacket("reserved subscription option bits set")
                if (options >> 4) & 0x03 == 3:
                    raise MalformedPacket("retain handling 3")
                subs.append(
                    Subscription(
                        topic_filter,
                        options & 0x03,
                        bool(options & 0x04),
                        bool(options & 0x08),
                        (options >> 4) & 0x03,
                    )
                )
            if not subs:
                raise MalformedPacket("SUBSCRIBE without a topic filter")
            return Subscribe(packet_id, tuple(subs), props)
        case PacketType.SUBACK | PacketType.UNSUBACK:
            packet_id = _packet_id(reader)
            props = read_properties(reader, kind) if v5 else NO_PROPERTIES
            codes = tuple(reader.rest())
            if kind == PacketType.SUBACK:
                return SubAck(packet_id, codes, props)
            return UnsubAck(packet_id, codes, props)
        case PacketType.UNSUBSCRIBE:
            packet_id = _packet_id(reader)
            props = read_properties(reader, kind) if v5 else NO_PROPERTIES
            filters = []
            while reader.remaining:
                filters.append(reader.utf8())
            if not filters:
                raise MalformedPacket("UNSUBSCRIBE without a topic filter")
            return Unsubscribe(packet_id, tuple(filters), props)
        case PacketType.PINGREQ:
            return PingReq()
        case PacketType.PINGRESP:
            return PingResp()
        case PacketType.DISCONNECT:
            reason, props = _reason_and_properties(reader, kind, v5)
            return Disconnect(reason, props)
        case PacketType.AUTH:
            if not v5:
                raise MalformedPacket("AUTH is not an MQTT 3.1.1 packet")
            reason, props = _reason_and_properties(reader, kind, v5)
            return Auth(reason, props)
    raise MalformedPacket(f"unexpected packet type {kind}")
