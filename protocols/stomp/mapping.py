"""How a STOMP SEND frame becomes a ``Publication`` (docs/protocols/stomp.md has the table).

Destinations: ``/queue/NAME`` → ``Publication(queue=NAME)``; ``/topic/a.b.c`` →
``Publication(topic="a/b/c")`` ('.' separators map to '/', DESIGN.md §3.1). Headers with a
meaning of their own map to fields; every other header is kept, as a string, in the
message properties, which is where the gateway looks for ``JMSXGroupID`` and
``QUEUE_PARTITION_KEY``. ``AMQ_SCHEDULED_DELAY`` (ActiveMQ, milliseconds) also sets the
delivery delay and stays a property.
"""

from __future__ import annotations

from typing import Final

from core.errors import InvalidArgument
from core.frozen import bare
from core.model import Publication, validate_name
from core.schedule import STOMP_DELAY_HEADER, delay_seconds
from core.topics import normalize_topic
from protocols._limits import parse_decimal
from protocols.stomp.errors import InvalidDestination, InvalidFrame
from protocols.stomp.frames import Frame

QUEUE_PREFIX: Final = "/queue/"
TOPIC_PREFIX: Final = "/topic/"

# Headers that are STOMP framing or map to a Publication field, never to a property.
MAPPED_HEADERS: Final = frozenset(
    {
        "destination",
        "content-length",
        "content-type",
        "receipt",
        "transaction",
        "expires",
        "correlation-id",
        "reply-to",
        "message-id",
    }
)


def destination_of(destination: str | None, receipt: str | None) -> tuple[str | None, str | None]:
    """(queue, topic) named by a SEND frame's ``destination`` header."""
    if destination is None:
        raise InvalidFrame("SEND frame without a destination header", receipt_id=receipt)
    if destination.startswith(QUEUE_PREFIX):
        name = destination[len(QUEUE_PREFIX) :]
        try:
            return validate_name("queue", name), None
        except InvalidArgument as e:
            raise InvalidDestination(
                f"invalid destination {destination!r}: {e.message}", receipt_id=receipt
            ) from e
    if destination.startswith(TOPIC_PREFIX):
        try:
            return None, normalize_topic(destination[len(TOPIC_PREFIX) :], ".")
        except InvalidArgument as e:
            raise InvalidDestination(
                f"invalid destination {destination!r}: {e.message}", receipt_id=receipt
            ) from e
    raise InvalidDestination(
        f"unknown destination {destination!r}: use /queue/NAME or /topic/a.b.c",
        receipt_id=receipt,
    )


def _expire_at(raw: str | None, receipt: str | None) -> float | None:
    if raw is None:
        return None
    millis = parse_decimal(raw)
    if millis is None:
        raise InvalidFrame(
            f"invalid expires header {raw[:40]!r}: milliseconds since the epoch",
            receipt_id=receipt,
        )
    return millis / 1000.0 if millis else None


def _delay(raw: str | None, receipt: str | None) -> float | None:
    if raw is None:
        return None
    try:
        return delay_seconds(STOMP_DELAY_HEADER, raw)
    except InvalidArgument as e:
        raise InvalidFrame(e.message, receipt_id=receipt) from e


def publication_from_send(frame: Frame, producer: str) -> Publication:
    """Build the Publication for a SEND frame; raise InvalidFrame for a bad header."""
    headers = frame.header_map()
    receipt = headers.get("receipt")
    queue, topic = destination_of(headers.get("destination"), receipt)
    made = bare(Publication)  # core.frozen: keywords without a dict of them
    Publication.__init__(
        made,
        payload=frame.body,
        queue=queue,
        topic=topic,
        properties={k: v for k, v in headers.items() if k not in MAPPED_HEADERS},
        expire_at=_expire_at(headers.get("expires"), receipt),
        delay=_delay(headers.get(STOMP_DELAY_HEADER), receipt),
        producer=producer,
        dedup_id=headers.get("message-id"),
        content_type=headers.get("content-type"),
        correlation_id=headers.get("correlation-id"),
        reply_to=headers.get("reply-to"),
    )
    return made


__all__ = ["MAPPED_HEADERS", "destination_of", "publication_from_send"]
