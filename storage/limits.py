"""The limits an append checks before anything is stored, shared by SqlStore and its
in-memory twin (storage/memory.py) so that both refuse exactly alike."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from core.errors import InvalidArgument, MessageTooLarge, QueueFull
from core.model import Message, QueueConfig

__all__ = ["check_append"]


def check_append(
    messages: Sequence[Message],
    queue: Callable[[str], QueueConfig],
    depths: Mapping[str, list[int]],
    pending: dict[str, list[int]],
) -> None:
    """Refuse the whole call (MessageTooLarge, InvalidArgument, QueueFull) unless every
    message fits its queue's size limit and partitions, and each queue's depth — stored
    (``depths``: count, bytes), plus ``pending`` (what earlier calls of the same
    transaction add), plus this call — stays within its limits. An accepted call's
    counts are added to ``pending``."""
    added: dict[str, list[int]] = {}
    configs: dict[str, QueueConfig] = {}
    for message in messages:
        config = configs.get(message.queue)
        if config is None:
            config = configs[message.queue] = queue(message.queue)
        if message.size > config.max_message_size:
            raise MessageTooLarge(
                f"message of {message.size} bytes exceeds {config.max_message_size} "
                f"allowed by queue {config.name!r}"
            )
        if not 0 <= message.partition < config.slots:
            raise InvalidArgument(f"queue {config.name!r} has no partition {message.partition}")
        totals = added.setdefault(message.queue, [0, 0])
        totals[0] += 1
        totals[1] += message.size
    for name, (count, size) in added.items():
        config = configs[name]
        stored = depths.get(name, [0, 0])
        before = pending.get(name, [0, 0])
        limit_messages, limit_bytes = config.max_depth_messages, config.max_depth_bytes
        if limit_messages is not None and stored[0] + before[0] + count > limit_messages:
            raise QueueFull(f"queue {name!r} holds its maximum of {limit_messages} messages")
        if limit_bytes is not None and stored[1] + before[1] + size > limit_bytes:
            raise QueueFull(f"queue {name!r} holds its maximum of {limit_bytes} bytes")
    for name, (count, size) in added.items():
        total = pending.setdefault(name, [0, 0])
        total[0] += count
        total[1] += size
