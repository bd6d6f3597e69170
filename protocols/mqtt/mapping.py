"""From an MQTT PUBLISH (or Will) to a keygate ``Publication`` — see docs/protocols/mqtt.md.

Correlation Data is binary in MQTT (any bytes, up to 65,535) and a string in keygate, and
no value of it may keep its message from being stored. It becomes ``correlation_id`` as
UTF-8 text when it decodes as UTF-8 without NUL (which no text column holds) and fits
``MAX_ID_BYTES``, else as lowercase hex when that fits, else there is none. The exact
bytes are always kept in the ``x-mqtt-correlation-data`` property (a bytes value, which
ingress does not limit; MQTT's Binary Data holds at most 65,535 bytes).

A user property name repeated in one packet keeps its first value (keygate properties are
a mapping). The user property ``x-delay`` (milliseconds) also delays delivery
(core.schedule). ``dedup-id`` is also the message's dedup id (MQTT has no message id of its own).
A Message Expiry Interval of 0 means no expiry, as when it is absent (a ttl is > 0).
"""

from __future__ import annotations

from typing import Final

from core.frozen import bare
from core.ingress import MAX_ID_BYTES
from core.model import PropertyValue, Publication
from core.schedule import DELAY_HEADER, delay_seconds
from protocols.mqtt.events import MqttProperties

CORRELATION_DATA_PROPERTY: Final = "x-mqtt-correlation-data"
PAYLOAD_FORMAT_PROPERTY: Final = "x-mqtt-payload-format-indicator"
RETAIN_PROPERTY: Final = "x-mqtt-retain"
DEDUP_ID_PROPERTY: Final = "dedup-id"


def payload_format_valid(payload: bytes, properties: MqttProperties) -> bool:
    """False when the Payload Format Indicator says UTF-8 and the payload is not (0x99)."""
    if properties.payload_format_indicator != 1:
        return True
    try:
        payload.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def correlation_id(data: bytes) -> str | None:
    """The ``correlation_id`` for Correlation Data ``data`` (see above)."""
    if len(data) <= MAX_ID_BYTES and b"\x00" not in data:
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            pass
    return data.hex() if 2 * len(data) <= MAX_ID_BYTES else None


def delay_of(properties: MqttProperties) -> float | None:
    """The delay (seconds) the ``x-delay`` user property asks for, first value winning;
    raises InvalidArgument for a value that is not milliseconds >= 0."""
    for name, value in properties.user_properties:
        if name == DELAY_HEADER:
            return delay_seconds(DELAY_HEADER, value)
    return None


def to_publication(
    topic: str, payload: bytes, properties: MqttProperties, *, retain: bool, client_id: str
) -> Publication:
    props: dict[str, PropertyValue] = {}
    for name, value in properties.user_properties:
        props.setdefault(name, value)
    if properties.correlation_data is not None:
        props[CORRELATION_DATA_PROPERTY] = properties.correlation_data
    if properties.payload_format_indicator is not None:
        props[PAYLOAD_FORMAT_PROPERTY] = properties.payload_format_indicator
    if retain:
        props[RETAIN_PROPERTY] = True
    expiry = properties.message_expiry_interval
    dedup_id = props.get(DEDUP_ID_PROPERTY)
    made = bare(Publication)  # core.frozen: keywords without a dict of them
    Publication.__init__(
        made,
        payload=payload,
        topic=topic,
        properties=props,
        ttl=float(expiry) if expiry else None,  # 0: no expiry, as absent (and Mosquitto)
        delay=delay_of(properties),
        producer=f"mqtt:{client_id}",
        dedup_id=dedup_id if isinstance(dedup_id, str) else None,
        content_type=properties.content_type,
        correlation_id=(
            correlation_id(properties.correlation_data)
            if properties.correlation_data is not None
            else None
        ),
        reply_to=properties.response_topic,
    )
    return made
