"""Structured logs: one JSON object per line, with the fields a log pipeline indexes."""

from __future__ import annotations

import json
import logging

import pytest

from core.model import GroupConfig, QueueConfig
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


def test_a_group_runtime_logs_its_queue_and_group_as_fields(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from gateway.runtime import GroupRuntime

    runtime = GroupRuntime(  # only its logger is used here
        store=None,  # type: ignore[arg-type]
        machine=None,  # type: ignore[arg-type]
        queue=QueueConfig("orders"),
        group=GroupConfig("orders", "billing"),
        hooks=None,  # type: ignore[arg-type]
        clock=lambda: 0.0,
    )
    with caplog.at_level(logging.INFO, logger="keygate.runtime"):
        runtime._log.warning("stuck")
    entry = json.loads(JsonFormatter().format(caplog.records[-1]))
    assert (entry["queue"], entry["group"], entry["message"]) == ("orders", "billing", "stuck")
