"""keygate's pure domain logic: model, keys, topics, assignment, delivery state machine.

No I/O here: time is passed in and every state machine returns actions (core.actions).
"""

from core.assignment import assign
from core.backoff import redelivery_delay
from core.group import GroupMachine
from core.ingress import validate_publication
from core.ledger import AckLedger
from core.partition import FlowStatus, GroupStatus, PartitionStatus
from core.topics import SubscriptionIndex, matches, normalize_topic, validate_pattern

__all__ = [
    "AckLedger",
    "FlowStatus",
    "GroupMachine",
    "GroupStatus",
    "PartitionStatus",
    "SubscriptionIndex",
    "assign",
    "matches",
    "normalize_topic",
    "redelivery_delay",
    "validate_pattern",
    "validate_publication",
]
