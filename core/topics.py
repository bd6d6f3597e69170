"""Topics, MQTT-style subscription patterns and the index that routes a publish to queues.

Topics are ``/``-separated levels (DESIGN.md §3.1); AMQP and STOMP use ``.`` and are mapped
to ``/``. Patterns use MQTT wildcards: ``+`` is exactly one whole level, ``#`` is the last
level and matches its parent level too (``a/#`` matches ``a``). Topics starting with ``$``
are not matched by a pattern whose first level is a wildcard (MQTT 3.1.1 §4.7.2).

``SubscriptionIndex`` is a trie over levels: matching walks at most one exact, one ``+`` and
one ``#`` branch per level, so its cost depends on the topic's depth and the number of
matching branches, never on the total number of subscriptions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from core.errors import InvalidArgument

SEPARATOR: Final = "/"
SINGLE: Final = "+"
MULTI: Final = "#"
_SEPARATORS: Final = frozenset({"/", "."})


def _check_text(kind: str, text: object) -> str:
    if not isinstance(text, str) or not text:
        raise InvalidArgument(f"{kind} must be a non-empty string")
    if "\x00" in text:
        raise InvalidArgument(f"{kind} must not contain NUL")
    return text


def _to_slashes(text: str, separator: str) -> str:
    if separator not in _SEPARATORS:
        raise InvalidArgument(f"topic separator must be '/' or '.', got {separator!r}")
    return text.replace(".", SEPARATOR) if separator == "." else text


def normalize_topic(topic: str, separator: str = SEPARATOR) -> str:
    """A publish topic in ``/`` form; ``separator='.'`` maps AMQP/STOMP dotted topics.

    Raises InvalidArgument for an empty topic, NUL or a wildcard character.
    """
    text = _to_slashes(_check_text("topic", topic), separator)
    if SINGLE in text or MULTI in text:
        raise InvalidArgument(f"a publish topic must not contain wildcards: {topic!r}")
    return text


def validate_pattern(pattern: str, separator: str = SEPARATOR) -> str:
    """A subscription pattern in ``/`` form, checked against MQTT wildcard rules."""
    text = _to_slashes(_check_text("subscription pattern", pattern), separator)
    levels = text.split(SEPARATOR)
    for index, level in enumerate(levels):
        if MULTI in level and (level != MULTI or index != len(levels) - 1):
            raise InvalidArgument(f"'#' must be the whole last level: {pattern!r}")
        if SINGLE in level and level != SINGLE:
            raise InvalidArgument(f"'+' must be a whole level: {pattern!r}")
    return text


def matches(pattern: str, topic: str) -> bool:
    """Whether ``topic`` matches the MQTT ``pattern`` (both in ``/`` form)."""
    plevels = pattern.split(SEPARATOR)
    tlevels = topic.split(SEPARATOR)
    if topic.startswith("$") and plevels[0] in (SINGLE, MULTI):
        return False
    for index, plevel in enumerate(plevels):
        if plevel == MULTI:
            return True
        if index >= len(tlevels):
            return False
        if plevel != SINGLE and plevel != tlevels[index]:
            return False
    return len(plevels) == len(tlevels)


@dataclass(slots=True)
class _Node:
    children: dict[str, _Node] = field(default_factory=dict)
    queues: set[str] = field(default_factory=set)

    def empty(self) -> bool:
        return not self.children and not self.queues


class SubscriptionIndex:
    """Which queues subscribe to a topic. Patterns are validated on ``add``."""

    def __init__(self) -> None:
        self._root = _Node()
        self._by_queue: dict[str, set[str]] = {}

    def __len__(self) -> int:
        return sum(len(patterns) for patterns in self._by_queue.values())

    def add(self, pattern: str, queue: str) -> None:
        pattern = validate_pattern(pattern)
        node = self._root
        for level in pattern.split(SEPARATOR):
            node = node.children.setdefault(level, _Node())
        node.queues.add(queue)
        self._by_queue.setdefault(queue, set()).add(pattern)

    def remove(self, pattern: str, queue: str) -> None:
        """Remove one subscription; removing an absent one does nothing."""
        patterns = self._by_queue.get(queue)
        if patterns is None or pattern not in patterns:
            return
        patterns.discard(pattern)
        if not patterns:
            del self._by_queue[queue]
        path = [self._root]
        levels = pattern.split(SEPARATOR)
        for level in levels:
            path.append(path[-1].children[level])
        path[-1].queues.discard(queue)
        # Prune branches that no longer lead to a subscription.
        for depth in range(len(levels), 0, -1):
            if not path[depth].empty():
                break
            del path[depth - 1].children[levels[depth - 1]]

    def remove_queue(self, queue: str) -> None:
        for pattern in sorted(self._by_queue.get(queue, ())):
            self.remove(pattern, queue)

    def patterns_of(self, queue: str) -> frozenset[str]:
        return frozenset(self._by_queue.get(queue, ()))

    def match(self, topic: str) -> frozenset[str]:
        """Names of the queues with at least one pattern matching ``topic``."""
        levels = topic.split(SEPARATOR)
        dollar = topic.startswith("$")
        found: set[str] = set()
        nodes = [self._root]
        for index, level in enumerate(levels):
            wildcards_allowed = not (index == 0 and dollar)
            next_nodes: list[_Node] = []
            for node in nodes:
                if wildcards_allowed:
                    multi = node.children.get(MULTI)
                    if multi is not None:
                        found.update(multi.queues)
                    single = node.children.get(SINGLE)
                    if single is not None:
                        next_nodes.append(single)
                exact = node.children.get(level)
                if exact is not None:
                    next_nodes.append(exact)
            nodes = next_nodes
            if not nodes:
                return frozenset(found)
        for node in nodes:
            found.update(node.queues)
            multi = node.children.get(MULTI)
            if multi is not None:
                found.update(multi.queues)
        return frozenset(found)
