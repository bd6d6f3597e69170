"""Structured logs: one JSON object per line, with the fields a log pipeline indexes."""

from __future__ import annotations

import json
import logging

from gateway.logs import JsonFormatter


def test_a_record_becomes_one_json_line_with_its_extra_fields() -> None:
    record = logging.LogRecord(
        "keygate.broker", logging.WARNING, __file__, 1, "queue %s is full", ("orders",), None
    )
    record.queue = "orders"
    line = JsonFormatter().format(record)
    entry = json.loads(line)
    assert "\n" not in line
    assert entry["level"] == "WARNING"
    assert entry["logger"] == "keygate.broker"
    assert entry["message"] == "queue orders is full"
    assert entry["queue"] == "orders"
    assert entry["time"].endswith("Z")


def test_an_exception_is_kept_in_the_entry() -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        record = logging.LogRecord("k", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    entry = json.loads(JsonFormatter().format(record))
    assert "ValueError: boom" in entry["exception"]
