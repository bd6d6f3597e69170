"""Queue settings of the wrong type, with the type the refusal names, and integer settings
out of their range, with the range it names: the unit test of QueueConfig and the wire,
HTTP and SDK tests check the same cases."""

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

# Each integer setting just past either end of its range (docs/operations.md, "Queues and
# groups"): INTEGER columns are 32 bits on PostgreSQL, BIGINT 64. (Past 64 bits no
# interface carries an integer: HTTP and the wire refuse it before the settings do.)
INT32_MAX: Final = 2**31 - 1
INT64_MAX: Final = 2**63 - 1
OUT_OF_RANGE: Final = [
    ("partitions", -1, "between 0 and 65536"),
    ("partitions", 65_537, "between 0 and 65536"),
    ("max_message_size", 0, f"between 1 and {INT32_MAX}"),
    ("max_message_size", INT32_MAX + 1, f"between 1 and {INT32_MAX}"),
    ("max_message_size", INT64_MAX, f"between 1 and {INT32_MAX}"),
    ("max_depth_messages", 0, f"between 1 and {INT64_MAX}"),
    ("max_depth_bytes", -1, f"between 1 and {INT64_MAX}"),
    ("max_deliveries", -1, f"between 0 and {INT32_MAX}"),
    ("max_deliveries", INT64_MAX, f"between 0 and {INT32_MAX}"),
    ("window", 0, f"between 1 and {INT32_MAX}"),
    ("window", 2**40, f"between 1 and {INT32_MAX}"),
]
# The largest value of each integer setting whose column bounds it: stored and read back
# on either database.
LARGEST: Final = {
    "max_message_size": INT32_MAX,
    "max_depth_messages": INT64_MAX,
    "max_depth_bytes": INT64_MAX,
    "max_deliveries": INT32_MAX,
    "window": INT32_MAX,
}
