"""Queue settings of the wrong type, with the type the refusal names: the unit test of
QueueConfig and the wire test of DECLARE_QUEUE check the same cases."""

from __future__ import annotations

from typing import Final

WRONG_TYPES: Final = [
    ("partitions", 2.0, "int"),
    ("partitions", True, "int"),
    ("partitions", b"\x02", "int"),
    ("max_deliveries", 3.0, "int"),
    ("window", 10.0, "int"),
    ("max_message_size", 100.0, "int"),
    ("max_depth_messages", 5.0, "int"),
    ("dead_letter_expired", 1, "bool"),
    ("rebalance_delay", "x", "float"),
    ("ttl", True, "float"),
    ("key_from", 3, "str"),
    ("on_dead_letter", b"continue", "str"),
]
