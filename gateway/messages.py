"""A publication becomes a stored message: its key, partition, id, schedule and expiry.

Pure apart from the time-ordered message id; the broker routes and authorizes first, then
calls ``build_message`` once per destination queue (the store allocates the seq).
"""

from __future__ import annotations

from core.errors import MessageTooLarge
from core.frozen import bare
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
    message = bare(Message)  # core.frozen: keywords without a dict of them
    Message.__init__(
        message,
        message_id=new_message_id(now),
        queue=queue.name,
        partition=partition_for(key, queue.partitions),
        seq=0,
        key=key,
        payload=publication.payload,
        properties=publication.properties,
        topic=topic,
        publish_time=now,
        deliver_at=_deliver_at(publication, now),
        expire_at=expire_at,
        producer=publication.producer,
        dedup_id=publication.dedup_id,
        content_type=publication.content_type,
        correlation_id=publication.correlation_id,
        reply_to=publication.reply_to,
        publisher=publisher,
    )
    if message.size > queue.max_message_size:
        raise MessageTooLarge(
            f"message of {message.size} bytes exceeds queue "
            f"{queue.name!r} max_message_size {queue.max_message_size}"
        )
    return message
