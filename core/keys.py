"""Partition keys and hashing (DESIGN.md §3.2, §3.3).

The hash is Pulsar's Murmur3_32Hash: ``(murmur3_32(key_utf8, seed=0) & 0x7FFFFFFF) % n``,
so a key lands on the same partition in keygate as in a Pulsar topic with the same
partition count.
"""

from __future__ import annotations

import random
from typing import Final

import mmh3

from core.model import (
    GROUP_ID_PROPERTY,
    PARTITION_KEY_PROPERTY,
    Properties,
    Publication,
    QueueConfig,
)

_MASK: Final = 0x7FFFFFFF


def murmur3_32(key: str) -> int:
    """Unsigned 32-bit murmur3 of the key's UTF-8 bytes, seed 0."""
    return int(mmh3.hash(key.encode("utf-8"), 0, signed=False))


def partition_for(key: str | None, partitions: int, rng: random.Random | None = None) -> int:
    """The partition of ``key`` among ``partitions`` (0 means one internal partition).

    No key picks a random partition (``rng`` lets tests make that deterministic).
    """
    slots = max(1, partitions)
    if key is None:
        return (rng or random).randrange(slots)
    return (murmur3_32(key) & _MASK) % slots


def _as_key(value: object) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def key_from_properties(properties: Properties) -> str | None:
    """``QUEUE_PARTITION_KEY`` first, then ``JMSXGroupID``."""
    for name in (PARTITION_KEY_PROPERTY, GROUP_ID_PROPERTY):
        if name in properties:
            return _as_key(properties[name])
    return None


def resolve_key(publication: Publication, queue: QueueConfig) -> str | None:
    """The partition key of ``publication`` for ``queue``, first found (DESIGN.md §3.2).

    The key properties (``QUEUE_PARTITION_KEY``, then ``JMSXGroupID``), then the key field
    (native PUBLISH, HTTP publish), then AMQP ``app_id`` when the queue says so, then the
    queue's ``topic:N`` rule.
    """
    key = key_from_properties(publication.properties)
    if key is not None:
        return key
    if publication.key is not None:
        return publication.key
    rule = queue.key_from
    if rule == "app_id":
        return publication.app_id
    if rule is not None and publication.topic is not None:
        level = int(rule.removeprefix("topic:"))
        levels = publication.topic.split("/")
        if level < len(levels) and levels[level]:
            return levels[level]
    return None
