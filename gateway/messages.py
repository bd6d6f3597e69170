"""A publication becomes a stored message: its key, partition, id, schedule, expiry and
dedup id (an empty one is none, whichever protocol carried it: DESIGN.md §3.6).

Pure apart from the time-ordered message id; the broker routes and authorizes first, then
calls ``build_message`` once per destination queue (the store allocates the seq).
"""

from __future__ import annotations

from core.errors import MessageTooLarge
from core.keys import partition_for, resolve_key
from core.model import Message, Publication, QueueConfig
from gateway.ids import new_message_id

__all__ = ["build_message"]


def _deliver_at(publication: Publication, now: float) -> float | None:
    """The scheduled delivery time: explicit, or publish time + a delay header's delay."""
    if publication.deliver_at is None and publication.delay:
        return now + publication.delay
    return publication.deliver_at


def build_message(
    queue: QueueConfig,
    publication: Publication,
    publisher: str | None,
    now: float,
    topic: str | None,
) -> Message:
    """The message ``publication`` stores in ``queue``; MessageTooLarge above its limit."""
    key = resolve_key(publication, queue)
    expire_at = publication.expire_at
    ttl = publication.ttl if publication.ttl is not None else queue.ttl
    if expire_at is None and ttl is not None:
        expire_at = now + ttl
    # Positional, in field order: a call naming more than 14 arguments makes CPython 3.11
    # build a dict of them at the call site, bare() or not (core.frozen): 2.4 µs
    # against 0.8 µs here.
    message = Message(
        new_message_id(now),  # message_id
        queue.name,  # queue
        partition_for(key, queue.partitions),  # partition
        0,  # seq: the store allocates it
        key,
        publication.payload,
        publication.properties,
        topic,
        now,  # publish_time
        _deliver_at(publication, now),
        expire_at,
        publication.producer,
        # An empty dedup id is no dedup id (AMQP clients that always send message_id
        # send ""): deduplicating on it would drop a producer's every later message.
        publication.dedup_id or None,
        publication.content_type,
        publication.correlation_id,
        publication.reply_to,
        publisher,
    )
    if message.size > queue.max_message_size:
        raise MessageTooLarge(
            f"message of {message.size} bytes exceeds queue "
            f"{queue.name!r} max_message_size {queue.max_message_size}"
        )
    return message
