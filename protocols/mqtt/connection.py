"""The sans-IO MQTT server connection: protocol rules between the codec and the listener.

Feed bytes with ``receive_data``; ``next_event`` returns what the listener must act on —
a ``ConnectRequest`` (authenticate, then ``accept``/``refuse``), a ``PublishRequest`` (run
``sink.publish``, then ``complete``) or an ``AnsweredPublish`` (a PUBLISH refused before
storage, or a QoS 2 one re-sent after it was stored: ``complete`` it in its turn, after
the publishes before it, so acks keep arrival order) — and answers everything else itself
(PINGRESP, SUBACK, PUBREL→PUBCOMP). Whatever must be written is collected
in ``data_to_send()``. A protocol violation raises ``MqttProtocolError`` after queueing the
MQTT 5 DISCONNECT (when one is allowed) and closing the state machine.

States: AWAIT_CONNECT → CONNECTING (authentication in flight; no further packet is read)
→ CONNECTED → CLOSED. Inbound flow control: at most ``receive_maximum`` QoS 1/2 publishes
may be unacknowledged (QoS 1 until PUBACK, QoS 2 until PUBCOMP); one more is 0x93.
"""

from __future__ import annotations

import dataclasses
import struct
import uuid
from dataclasses import dataclass
from enum import Enum
from typing import Final, NoReturn

from core.errors import InvalidArgument, KeygateError
from core.model import Publication
from protocols._limits import DEFAULT_MAX_LOGIN_FRAME
from protocols.mqtt.codec import MqttCodec
from protocols.mqtt.errors import (
    MqttProtocolError,
    PayloadFormatInvalid,
    UnsupportedProtocolVersion,
)
from protocols.mqtt.events import (
    MQTT_3_1_1,
    MQTT_5,
    NO_PROPERTIES,
    Auth,
    ConnAck,
    Connect,
    ConnectReturnCode,
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
    ReasonCode,
    SubAck,
    Subscribe,
    UnsubAck,
    Unsubscribe,
)
from protocols.mqtt.mapping import delay_of, payload_format_valid, to_publication
from protocols.mqtt.session import Session

KEEP_ALIVE_GRACE: Final = 1.5
# The longest session expiry granted (seconds); a session asking for more gets this.
MAX_SESSION_EXPIRY: Final = 7200.0
SUBSCRIBE_REFUSED: Final = "keygate does not deliver over MQTT: consume with the native SDK"
# MQTT 5 CONNACK reason → MQTT 3.1.1 return code; anything else closes without CONNACK.
_V3_RETURN_CODES: Final = {
    ReasonCode.UNSUPPORTED_PROTOCOL_VERSION: ConnectReturnCode.UNACCEPTABLE_PROTOCOL_VERSION,
    ReasonCode.CLIENT_IDENTIFIER_NOT_VALID: ConnectReturnCode.IDENTIFIER_REJECTED,
    ReasonCode.BAD_USER_NAME_OR_PASSWORD: ConnectReturnCode.BAD_USER_NAME_OR_PASSWORD,
    ReasonCode.NOT_AUTHORIZED: ConnectReturnCode.NOT_AUTHORIZED,
    ReasonCode.SERVER_UNAVAILABLE: ConnectReturnCode.SERVER_UNAVAILABLE,
    ReasonCode.SERVER_BUSY: ConnectReturnCode.SERVER_UNAVAILABLE,
    ReasonCode.SERVER_SHUTTING_DOWN: ConnectReturnCode.SERVER_UNAVAILABLE,
    ReasonCode.QUOTA_EXCEEDED: ConnectReturnCode.SERVER_UNAVAILABLE,
}

# A PUBACK or PUBREC with reason 0 and no properties: first byte, length 2, packet id.
_PLAIN_ACK: Final = struct.Struct(">BBH")
_PUBACK: Final = PacketType.PUBACK << 4
_PUBREC: Final = PacketType.PUBREC << 4


class State(Enum):
    AWAIT_CONNECT = "await-connect"
    CONNECTING = "connecting"
    CONNECTED = "connected"
    CLOSED = "closed"


@dataclass(frozen=True, slots=True)
class ConnectRequest:
    """Authenticate ``connect``; ``client_id`` is the one to use (assigned when empty)."""

    connect: Connect
    client_id: str


@dataclass(frozen=True, slots=True)
class PublishRequest:
    """Store ``publication``; then call ``complete`` (QoS 1/2) to send the acknowledgement."""

    publication: Publication
    qos: int
    packet_id: int | None

    @property
    def topic(self) -> str | None:
        return self.publication.topic


@dataclass(frozen=True, slots=True)
class AnsweredPublish:
    """A PUBLISH the connection answers without storing it: refused before storage
    (``error``: its payload format, its ``x-delay``; counted and, QoS 1/2, acknowledged
    with ``publish_reason(error)`` like a publish the sink refused), or a QoS 2 PUBLISH
    re-sent after it was stored (``error`` None: PUBREC again, nothing stored or counted).
    Either goes through ``complete`` in arrival order, after the acks of the publishes
    before it [MQTT-4.6.0-2/3], which wait for their commit."""

    topic: str
    qos: int
    packet_id: int | None
    error: KeygateError | None


@dataclass(frozen=True, slots=True)
class ReleaseRequest:
    """PUBREL of a stored QoS 2 message: make the release durable (the stored session no
    longer waits for ``packet_id``), then call ``released`` to send the PUBCOMP. Until
    then a re-sent PUBLISH with that id would still be taken as the same message, which
    is right: the client reuses an id only after PUBCOMP."""

    packet_id: int


Request = ConnectRequest | PublishRequest | AnsweredPublish | ReleaseRequest


@dataclass(frozen=True, slots=True)
class Limits:
    """What this server advertises and enforces."""

    max_packet_size: int
    receive_maximum: int = 1024
    topic_alias_maximum: int = 64
    max_session_expiry: float = MAX_SESSION_EXPIRY
    max_login_packet: int = DEFAULT_MAX_LOGIN_FRAME
    """The largest packet accepted before CONNACK (the CONNECT, Will included)."""


def _valid_topic_name(topic: str) -> bool:
    return bool(topic) and "+" not in topic and "#" not in topic


class ServerConnection:
    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.state = State.AWAIT_CONNECT
        self.codec = MqttCodec(max_packet_size=min(limits.max_login_packet, limits.max_packet_size))
        self.client_id: str | None = None
        self.keep_alive = 0.0
        self.last_received = 0.0
        self.session: Session | None = None
        # The Will to publish when the connection ends other than by a normal DISCONNECT.
        self.will: Publication | None = None
        self.will_delay = 0.0
        self._connect: Connect | None = None
        self._out = bytearray()
        self._inflight: set[int] = set()
        self._qos2_pending: set[int] = set()
        self._aliases: dict[int, str] = {}
        self._client_max_packet = 0
        self._problem_info = True

    @property
    def v5(self) -> bool:
        return self.codec.version == MQTT_5

    @property
    def keep_alive_deadline(self) -> float | None:
        """When the connection is dead for lack of traffic (1.5 x keep-alive), if ever."""
        if self.state is not State.CONNECTED or not self.keep_alive:
            return None
        return self.last_received + KEEP_ALIVE_GRACE * self.keep_alive

    @property
    def unacknowledged(self) -> int:
        return len(self._inflight)

    def data_to_send(self) -> bytes:
        data = bytes(self._out)
        self._out.clear()
        return data

    def receive_data(self, data: bytes, now: float) -> None:
        self.last_received = now
        self.codec.receive_data(data)

    def next_event(self) -> Request | None:
        """The next thing for the listener to do, or None (need more data, or waiting)."""
        while self.state in (State.AWAIT_CONNECT, State.CONNECTED):
            try:
                if self.state is State.AWAIT_CONNECT and self.codec.peek_type() not in (
                    None,
                    PacketType.CONNECT,
                ):
                    # [MQTT-3.1.0-1]: judged on the first byte, not after a claimed body.
                    raise MqttProtocolError("the first packet must be CONNECT")
                packet = self.codec.next_event()
                if packet is None:
                    return None
                request = self._handle(packet)
            except UnsupportedProtocolVersion:
                # Answered in 3.1.1 layout, which every MQTT client can read (§3.1.2.2).
                self._out += MqttCodec(version=MQTT_3_1_1).send(
                    ConnAck(False, ConnectReturnCode.UNACCEPTABLE_PROTOCOL_VERSION)
                )
                self.state = State.CLOSED
                raise
            except MqttProtocolError as e:
                self._fail(e.reason_code)
                raise
            if request is not None:
                return request
        return None

    def _send(self, packet: Packet) -> None:
        data = self.codec.send(packet)
        if (
            isinstance(packet, PubAck | PubRec | PubComp | SubAck | UnsubAck)
            and packet.properties is not NO_PROPERTIES
            and (not self._problem_info or len(data) > self._client_max_packet)
        ):
            # §3.1.2.11.7 and .4: drop the reason string when not wanted or too big.
            data = self.codec.send(dataclasses.replace(packet, properties=NO_PROPERTIES))
        self._out += data

    def _fail(self, reason: ReasonCode) -> None:
        if self.state is State.CONNECTED and self.v5:
            self._send(Disconnect(reason))
        self.state = State.CLOSED

    def disconnect(self, reason: ReasonCode) -> None:
        """Close from the server side (takeover 0x8E, keep-alive 0x8D, shutdown 0x8B)."""
        if self.state is not State.CLOSED:
            self._fail(reason)

    def keep_alive_expired(self, now: float) -> bool:
        deadline = self.keep_alive_deadline
        if deadline is None or now < deadline:
            return False
        self.disconnect(ReasonCode.KEEP_ALIVE_TIMEOUT)
        return True

    # ---- CONNECT ----------------------------------------------------------------------

    def _on_connect(self, packet: Connect) -> ConnectRequest:
        self._connect = packet
        self.keep_alive = float(packet.keep_alive)
        props = packet.properties
        self._client_max_packet = props.maximum_packet_size or self.limits.max_packet_size
        self._problem_info = props.request_problem_information != 0
        self.state = State.CONNECTING
        client_id = packet.client_id
        if not client_id:
            if packet.protocol_level != MQTT_5 and not packet.clean_start:
                self._reject(ReasonCode.CLIENT_IDENTIFIER_NOT_VALID)
            client_id = f"keygate-{uuid.uuid4().hex}"
        if props.authentication_method is not None:
            self._reject(ReasonCode.BAD_AUTHENTICATION_METHOD)
        will = packet.will
        if will is not None:
            if not _valid_topic_name(will.topic):
                self._reject(ReasonCode.TOPIC_NAME_INVALID)
            if not payload_format_valid(will.payload, will.properties):
                self._reject(ReasonCode.PAYLOAD_FORMAT_INVALID)
            try:
                delay_of(will.properties)
            except InvalidArgument:
                self._reject(ReasonCode.IMPLEMENTATION_SPECIFIC_ERROR)
        return ConnectRequest(packet, client_id)

    def _reject(self, reason: ReasonCode) -> NoReturn:
        """Refuse a CONNECT that is wrong whatever the credentials."""
        self.refuse(reason)
        raise MqttProtocolError(f"CONNECT refused: {reason.name}", reason)

    def refuse(self, reason: ReasonCode) -> None:
        """Answer CONNECT with a failure CONNACK (when 3.1.1 has a code for it) and close."""
        if self.v5:
            self._send(ConnAck(False, reason))
        elif reason in _V3_RETURN_CODES:
            self._send(ConnAck(False, _V3_RETURN_CODES[reason]))
        self.state = State.CLOSED

    def accept(self, session: Session, session_present: bool, client_id: str) -> None:
        """Send CONNACK for the authenticated CONNECT, bound to ``session``."""
        assert self._connect is not None and self.state is State.CONNECTING
        packet = self._connect
        self.client_id = client_id
        self.session = session
        if self.v5:
            requested = packet.properties.session_expiry_interval or 0
        else:
            requested = 0 if packet.clean_start else int(self.limits.max_session_expiry)
        expiry = min(requested, int(self.limits.max_session_expiry))
        session.expiry_interval = float(expiry)
        if packet.will is not None:
            will = packet.will
            self.will_delay = float(will.properties.will_delay_interval or 0)
            self.will = to_publication(
                will.topic, will.payload, will.properties, retain=will.retain, client_id=client_id
            )
        self.state = State.CONNECTED
        self.codec.max_packet_size = self.limits.max_packet_size
        props = MqttProperties()
        if self.v5:
            props = MqttProperties(
                session_expiry_interval=expiry if expiry != requested else None,
                assigned_client_identifier=client_id if client_id != packet.client_id else None,
                receive_maximum=self.limits.receive_maximum,
                maximum_packet_size=self.limits.max_packet_size,
                topic_alias_maximum=self.limits.topic_alias_maximum,
                wildcard_subscription_available=0,
                subscription_identifier_available=0,
                shared_subscription_available=0,
            )
        self._send(ConnAck(session_present, ReasonCode.SUCCESS, props))

    # ---- packets after CONNECT ---------------------------------------------------------

    def _handle(self, packet: Packet) -> Request | None:
        if self.state is State.AWAIT_CONNECT:
            if not isinstance(packet, Connect):
                raise MqttProtocolError("the first packet must be CONNECT")
            return self._on_connect(packet)
        match packet:
            case Publish():
                return self._on_publish(packet)
            case PubRel():
                return self._on_pubrel(packet)
            case PingReq():
                self._send(PingResp())
            case Subscribe():
                codes = ReasonCode.IMPLEMENTATION_SPECIFIC_ERROR if self.v5 else 0x80
                self._send(
                    SubAck(
                        packet.packet_id,
                        (codes,) * len(packet.subscriptions),
                        MqttProperties(reason_string=SUBSCRIBE_REFUSED),
                    )
                )
            case Unsubscribe():
                codes_v5 = (ReasonCode.NO_SUBSCRIPTION_EXISTED,) * len(packet.topic_filters)
                self._send(UnsubAck(packet.packet_id, codes_v5 if self.v5 else ()))
            case Disconnect():
                self._on_disconnect(packet)
            case Auth():
                raise MqttProtocolError("enhanced authentication is not supported")
            case _:
                raise MqttProtocolError(f"{type(packet).__name__} is not sent by a client")
        return None

    def _on_disconnect(self, packet: Disconnect) -> None:
        expiry = packet.properties.session_expiry_interval
        if expiry is not None and self.session is not None:
            if self.session.expiry_interval == 0 and expiry:
                raise MqttProtocolError("session expiry changed from 0 on DISCONNECT")
            self.session.expiry_interval = float(min(expiry, self.limits.max_session_expiry))
        if packet.reason_code != ReasonCode.DISCONNECT_WITH_WILL:
            self.will = None
        self.state = State.CLOSED

    def _resolve_topic(self, packet: Publish) -> str:
        alias = packet.properties.topic_alias
        if alias is None:
            topic = packet.topic
        elif not 0 < alias <= self.limits.topic_alias_maximum:
            raise MqttProtocolError(
                f"topic alias {alias} out of range", ReasonCode.TOPIC_ALIAS_INVALID
            )
        elif packet.topic:
            self._aliases[alias] = topic = packet.topic
        elif alias in self._aliases:
            topic = self._aliases[alias]
        else:
            raise MqttProtocolError(f"topic alias {alias} was never set")
        if not _valid_topic_name(topic):
            raise MqttProtocolError(f"invalid topic name {topic!r}", ReasonCode.TOPIC_NAME_INVALID)
        return topic

    def _on_publish(self, packet: Publish) -> PublishRequest | AnsweredPublish | None:
        assert self.session is not None and self.client_id is not None
        if packet.properties.subscription_identifiers:
            raise MqttProtocolError("a client PUBLISH must not carry a Subscription Identifier")
        topic = self._resolve_topic(packet)
        packet_id = packet.packet_id
        if packet_id is not None:
            if packet.qos == 2 and packet_id in self.session.qos2_received:
                return AnsweredPublish(topic, 2, packet_id, None)  # re-sent, already stored
            if packet.qos == 2 and packet_id in self._qos2_pending:
                return None  # its PUBREC follows the commit already in flight
            if packet_id not in self._inflight:
                # 3.1.1 has no Receive Maximum: there the listener just stops reading.
                if self.v5 and len(self._inflight) >= self.limits.receive_maximum:
                    raise MqttProtocolError(
                        "more unacknowledged publishes than Receive Maximum",
                        ReasonCode.RECEIVE_MAXIMUM_EXCEEDED,
                    )
                self._inflight.add(packet_id)
            if packet.qos == 2:
                self._qos2_pending.add(packet_id)
        if not payload_format_valid(packet.payload, packet.properties):
            return AnsweredPublish(topic, packet.qos, packet_id, PayloadFormatInvalid())
        try:
            publication = to_publication(
                topic,
                packet.payload,
                packet.properties,
                retain=packet.retain,
                client_id=self.client_id,
            )
        except InvalidArgument as e:  # an x-delay that is not a delay
            return AnsweredPublish(topic, packet.qos, packet_id, e.as_outcome())
        return PublishRequest(publication, packet.qos, packet_id)

    def complete(
        self, qos: int, packet_id: int | None, reason: ReasonCode, detail: str | None = None
    ) -> None:
        """The sink call for a publish ended with ``reason``: acknowledge it.

        ``detail`` (the sink's error message) becomes the MQTT 5 Reason String.

        The session learns of a stored QoS 2 message even when the connection has
        already closed, so the PUBLISH re-sent after a reconnect is not stored twice.

        MQTT 3.1.1 has no negative PUBACK/PUBREC, and a confirm means stored (DESIGN.md
        §3.7): a refusal (reason >= 0x80) closes the connection unacknowledged instead,
        so the client keeps the message and sends it again after reconnecting.
        """
        if packet_id is None or self.session is None:
            return
        if qos == 2 and packet_id in self._qos2_pending:
            # Its first answer (a re-sent one's must not undo a release made since).
            self._qos2_pending.discard(packet_id)
            if reason < 0x80:
                self.session.qos2_received.add(packet_id)
        if qos == 1 or reason >= 0x80:
            self._inflight.discard(packet_id)
        if self.state is State.CLOSED:
            return
        if reason >= 0x80 and not self.v5:
            self._fail(reason)
            return
        if reason == ReasonCode.SUCCESS and detail is None:
            # The usual ack, the same bytes in 3.1.1 and 5 (§3.4.2.1: reason 0 is omitted).
            self._out += _PLAIN_ACK.pack(_PUBACK if qos == 1 else _PUBREC, 2, packet_id)
            return
        props = NO_PROPERTIES if detail is None else MqttProperties(reason_string=detail)
        ack = PubAck if qos == 1 else PubRec
        self._send(ack(packet_id, reason, props))

    def _on_pubrel(self, packet: PubRel) -> ReleaseRequest | None:
        assert self.session is not None
        packet_id = packet.packet_id
        if packet_id in self.session.qos2_received:
            return ReleaseRequest(packet_id)
        self._inflight.discard(packet_id)
        self._send(PubComp(packet_id, ReasonCode.PACKET_IDENTIFIER_NOT_FOUND))
        return None

    def released(self, packet_id: int) -> None:
        """The release of ``packet_id`` is durable: forget it and send the PUBCOMP."""
        if self.session is not None:
            self.session.qos2_received.discard(packet_id)
        self._inflight.discard(packet_id)
        if self.state is not State.CLOSED:
            self._send(PubComp(packet_id))


__all__ = [
    "AnsweredPublish",
    "ConnectRequest",
    "Limits",
    "PublishRequest",
    "ReleaseRequest",
    "Request",
    "ServerConnection",
    "State",
]
