"""MQTT 3.1.1 and 5.0, publish side: a sans-IO codec and server state machine, and an
asyncio listener that hands every PUBLISH to a ``protocols.sink.Sink``.

See docs/protocols/mqtt.md for the field mapping, reason codes and limits.
"""

from protocols.mqtt.codec import MqttCodec
from protocols.mqtt.connection import ConnectRequest, Limits, PublishRequest, ServerConnection
from protocols.mqtt.errors import (
    MalformedPacket,
    MqttProtocolError,
    PacketTooLarge,
    UnsupportedProtocolVersion,
)
from protocols.mqtt.events import (
    MQTT_3_1_1,
    MQTT_5,
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
    Subscription,
    UnsubAck,
    Unsubscribe,
    Will,
)
from protocols.mqtt.listener import MqttListener, MqttStats
from protocols.mqtt.session import Session, SessionStore

__all__ = [
    "MQTT_3_1_1",
    "MQTT_5",
    "Auth",
    "ConnAck",
    "Connect",
    "ConnectRequest",
    "ConnectReturnCode",
    "Disconnect",
    "Limits",
    "MalformedPacket",
    "MqttCodec",
    "MqttListener",
    "MqttProperties",
    "MqttProtocolError",
    "MqttStats",
    "Packet",
    "PacketTooLarge",
    "PacketType",
    "PingReq",
    "PingResp",
    "PubAck",
    "PubComp",
    "PubRec",
    "PubRel",
    "Publish",
    "PublishRequest",
    "ReasonCode",
    "ServerConnection",
    "Session",
    "SessionStore",
    "SubAck",
    "Subscribe",
    "Subscription",
    "UnsubAck",
    "Unsubscribe",
    "UnsupportedProtocolVersion",
    "Will",
]
