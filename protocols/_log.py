"""A connection's logger: every line carries the connection's identity as fields.

``ConnectionLog`` adds ``protocol`` and ``peer`` to each record and, once the connection
authenticated, ``client`` and ``user``; lines about one flow add ``flow`` (and ``queue``,
``group``) through ``extra=``. With ``log_json`` (gateway/logs.py) they are JSON keys, so
"everything about client X" is one filter in a log pipeline, not a text search.
"""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any

from protocols.sink import Principal


class ConnectionLog(logging.LoggerAdapter[logging.Logger]):
    def __init__(self, logger: logging.Logger, protocol: str, peer: object) -> None:
        super().__init__(logger, {"protocol": protocol, "peer": str(peer)})

    def authenticated(self, principal: Principal) -> None:
        assert isinstance(self.extra, dict)
        self.extra["client"] = principal.client_id
        self.extra["user"] = principal.username

    def process(
        self, msg: Any, kwargs: MutableMapping[str, Any]
    ) -> tuple[Any, MutableMapping[str, Any]]:
        kwargs["extra"] = {**(self.extra or {}), **kwargs.get("extra", {})}
        return msg, kwargs


__all__ = ["ConnectionLog"]
