"""A queue's settings as the native protocol's DECLARE_QUEUE / QUEUE_OK map carries them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from core.errors import InvalidArgument
from core.model import QueueConfig
from core.settings import SETTING_NAMES
from protocols.native.events import SettingValue


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
    unknown = set(settings) - SETTING_NAMES
    if unknown:
        raise InvalidArgument(f"unknown queue settings: {', '.join(sorted(unknown))}")
    try:
        return QueueConfig(name=name, subscriptions=tuple(subscriptions or ()), **settings)
    except TypeError as e:
        raise InvalidArgument(str(e)) from e


__all__ = ["queue_from_settings", "queue_settings"]
