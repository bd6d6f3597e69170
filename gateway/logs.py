"""Logging for ``keygate serve``: human-readable lines by default, or one JSON object per
line (``log_json = true`` / ``KEYGATE_LOG_JSON=1``) for log pipelines."""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Final

from aiohttp.http_exceptions import HttpProcessingError

from protocols.sink import Principal

# Attributes every LogRecord has; anything else was passed with ``extra=`` and is kept.
_STANDARD: Final = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD:
                entry[key] = value
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def flow_fields(
    flow_id: str, queue: str, group: str, principal: Principal, client: str
) -> dict[str, object]:
    """The structured fields of a log line about one flow (JSON keys with log_json): the
    same keys on every such line, so a pipeline can follow a flow from bind to unbind."""
    return {
        "flow": flow_id,
        "queue": queue,
        "group": group,
        "protocol": principal.protocol,
        "client": client,
        "user": principal.username,
    }


class _BadRequestLine(logging.Filter):
    """aiohttp logs a request it cannot parse at ERROR with a traceback whose message
    quotes the offending bytes: an oversized ``Authorization`` header put the start of a
    client's Basic credentials in the log, and a storm of bad requests wrote a traceback
    each. Such a request is the client's error (it is answered 400 and closed), so it
    becomes one INFO line like the other listeners' protocol errors, naming the kind of
    error and never the bytes."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, HttpProcessingError):
            peer = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
            record.msg = "http %s: bad request: %s (%s)"
            record.args = (peer, type(error).__name__, error.code)
            record.exc_info = record.exc_text = None
            record.levelno, record.levelname = logging.INFO, "INFO"
            return logging.getLogger(record.name).isEnabledFor(logging.INFO)
        return True


_BAD_REQUEST_LINE: Final = _BadRequestLine()


def quiet_bad_requests() -> None:
    """Install the filter above on aiohttp's server logger (once; both HTTP servers)."""
    server_log = logging.getLogger("aiohttp.server")
    if _BAD_REQUEST_LINE not in server_log.filters:
        server_log.addFilter(_BAD_REQUEST_LINE)


def configure(level: str, *, as_json: bool) -> None:
    handler = logging.StreamHandler()
    if as_json:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
    logging.basicConfig(level=level, handlers=[handler], force=True)
    # Alembic narrates every migration step at INFO; keygate logs the outcome itself.
    logging.getLogger("alembic").setLevel(logging.WARNING)
