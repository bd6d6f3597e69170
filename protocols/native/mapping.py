"""Between the native protocol's frames and keygate's model (docs/native-protocol.md §4).

PUBLISH becomes a ``Publication`` field for field (a delivery's DELIVER is written from
its message directly: ``ServerConnection.append_deliver``). A queue's settings travel as
the DECLARE_QUEUE / QUEUE_OK map, named as ``QueueConfig``'s fields (core/settings.py):
the gateway refuses a name it does not know, the SDK ignores one it does not know (a
newer gateway's).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from core.errors import InvalidArgument
from core.frozen import bare
from core.model import Publication, QueueConfig
from core.settings import SETTING_NAMES
from protocols.native.events import Publish, QueueOk, SettingValue


def publication(event: Publish, producer: str) -> Publication:
    made = bare(Publication)  # core.frozen: keywords without a dict of them
    Publication.__init__(
        made,
        payload=event.payload,
        queue=event.queue,
        topic=event.topic,
        key=event.key,
        properties=event.properties,
        ttl=event.ttl,
        deliver_at=event.deliver_at,
        producer=producer,
        dedup_id=event.dedup_id,
        content_type=event.content_type,
        correlation_id=event.correlation_id,
        reply_to=event.reply_to,
    )
    return made


def check_setting_names(names: Iterable[str]) -> None:
    """Raises InvalidArgument naming the settings that are not a queue's."""
    unknown = set(names) - SETTING_NAMES
    if unknown:
        raise InvalidArgument(f"unknown queue settings: {', '.join(sorted(unknown))}")


def queue_settings(config: QueueConfig) -> dict[str, SettingValue]:
    """A queue's settings as the QUEUE_OK map (None values left out)."""
    out: dict[str, SettingValue] = {}
    for name in sorted(SETTING_NAMES):
        value = getattr(config, name)
        if value is not None:
            out[name] = value
    out["dead_letter_queue"] = config.dlq_name or ""
    return out


def queue_from_settings(
    name: str, settings: dict[str, Any], subscriptions: Sequence[str] | None
) -> QueueConfig:
    """The queue a DECLARE_QUEUE asks for. Raises InvalidArgument."""
    check_setting_names(settings)
    try:
        return QueueConfig(name=name, subscriptions=tuple(subscriptions or ()), **settings)
    except TypeError as e:
        raise InvalidArgument(str(e)) from e


def queue_from_ok(reply: QueueOk) -> QueueConfig:
    """The queue a QUEUE_OK describes, ignoring settings this version does not know."""
    known = {k: v for k, v in reply.settings.items() if k in SETTING_NAMES}
    return QueueConfig(name=reply.name, subscriptions=reply.subscriptions, **known)  # type: ignore[arg-type]


__all__ = [
    "check_setting_names",
    "publication",
    "queue_from_ok",
    "queue_from_settings",
    "queue_settings",
]
