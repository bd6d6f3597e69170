"""The admin HTTP API (JSON) and ``/metrics`` (Prometheus text format).

    GET    /                                the web console (gateway/console/)
    GET    /healthz                         liveness and role (a standby answers 503)
    GET    /metrics                         Prometheus metrics
    GET    /api/openapi.json                this API as an OpenAPI 3.1 document
    GET    /api/status                      role, name, version, database, listeners
    GET    /api/queues                      every queue with its settings and stats
    POST   /api/queues                      create: {"name": ..., "partitions": ..., ...}
    GET    /api/queues/{name}               one queue, its settings and stats
    PATCH  /api/queues/{name}               alter settings
    DELETE /api/queues/{name}               delete (messages, groups, offsets)
    POST   /api/queues/{name}/purge         drop every message, keep settings and groups
    POST   /api/queues/{name}/redrive       move dead letters back: {"to": queue, "limit": K,
                                            "key": K} (all optional; default: the original
                                            queue of each letter, every letter)
    GET    /api/queues/{name}/inspect       groups, partitions and flows (PAI-EAS style)
    GET    /api/queues/{name}/groups        the queue's consumer groups and their settings
    POST   /api/queues/{name}/groups        create: {"name": ..., "mode": ..., "key_order": ...,
                                            "start": ..., "tags": {...}, "ack_timeout": ...}
    DELETE /api/queues/{name}/groups/{group}  delete a group and its progress
    POST   /api/queues/{name}/groups/{group}/reset  replay or skip: {"to": "earliest" |
                                            "latest" | "seq:P=N,..." | "time:ISO8601",
                                            "force": bool}
    GET    /api/queues/{name}/messages      browse stored messages without consuming them:
                                            ?partition=P&from_seq=N&limit=K (limit <= 1000)
    POST   /api/queues/{name}/messages      publish: {"payload": str | "payload_b64": str,
                                            "key": ..., "properties": {...}, "ttl": s,
                                            "delay": s, "dedup_id": ..., "content_type": ...}
    POST   /api/topics/{topic}/messages     publish to a topic (same body)

Errors are ``{"error": code, "message": text}`` with the KeygateError's HTTP status; an
unknown path or method answers the same way (``not-found``, ``method-not-allowed``).
Request bodies and query parameters are checked against the OpenAPI document before a
handler uses them (``gateway/http_input.py``); a queue named in the path is looked up
before its group, so a missing queue is ``queue-not-found`` on every route under it.
"""

from __future__ import annotations

import base64
import binascii
import logging
import platform
import ssl
from collections.abc import Mapping
from typing import Any, Final

from aiohttp import web

from core.errors import InvalidArgument, KeygateError
from core.model import (
    GroupConfig,
    GroupMode,
    KeyOrder,
    Publication,
    QueueConfig,
    ResetPosition,
    StartPosition,
    validate_name,
)
from core.settings import queue_settings
from gateway import group_ops
from gateway.broker import Broker
from gateway.console import STATIC_DIR
from gateway.http_guard import PRINCIPAL, Guard, json_errors, same_origin
from gateway.http_input import RequestContract
from gateway.http_server import HttpConnections, HttpStats, app_runner, read_body, serve
from gateway.inspect import inspect_queue, queue_json, queue_summaries, queue_summary
from gateway.openapi import openapi_document, package_version
from protocols.sink import Principal
from storage import SqlStore

log = logging.getLogger("keygate.http")

# The largest request body (413 beyond): a message of the default 5 MiB maximum fits,
# base64-encoded, in a JSON publish. It was 64 MiB: a few clients posting that much held
# a gigabyte and parsed it on the event loop long enough for the gateway to lose its lease.
MAX_BODY: Final = 8 * 1024 * 1024


def queue_from_json(body: dict[str, Any]) -> QueueConfig:
    settings = queue_settings({k: v for k, v in body.items() if k != "name"})
    return QueueConfig(body["name"], **settings)  # type: ignore[arg-type]


def group_json(group: GroupConfig) -> dict[str, Any]:
    return {
        "queue": group.queue,
        "name": group.name,
        "mode": group.mode.value,
        "key_order": group.key_order.value,
        "start": group.start.value,
        "tags": dict(group.tags or {}),
        "ack_timeout": group.ack_timeout,
    }


def group_from_json(queue: str, body: dict[str, Any], default_mode: GroupMode) -> GroupConfig:
    """A group from a body checked against the document (types, enums)."""
    return GroupConfig(
        queue,
        body["name"],
        GroupMode(body.get("mode", default_mode)),
        KeyOrder(body.get("key_order", KeyOrder.PARTITION)),
        StartPosition(body.get("start", StartPosition.EARLIEST)),
        body.get("tags") or None,
        body.get("ack_timeout"),
    )


def publication_from_json(
    body: dict[str, Any], *, queue: str | None, topic: str | None
) -> Publication:
    """A publication from a body checked against the document (types, ranges, fields)."""
    if "payload_b64" in body:
        if "payload" in body:
            raise InvalidArgument("give payload or payload_b64, not both")
        try:
            payload = base64.b64decode(body["payload_b64"], validate=True)
        except (binascii.Error, ValueError) as e:
            raise InvalidArgument(f"payload_b64 is not base64: {e}") from e
    else:
        payload = body.get("payload", "").encode()
    return Publication(
        payload=payload,
        key=body.get("key"),
        properties=body.get("properties") or {},
        ttl=body.get("ttl"),
        delay=body.get("delay"),
        producer="http",
        dedup_id=body.get("dedup_id"),
        content_type=body.get("content_type"),
        queue=queue,
        topic=topic,
    )


def _principal(request: web.Request) -> Principal:
    return request[PRINCIPAL]


def browsed_json(row: dict[str, Any]) -> dict[str, Any]:
    """A browsed kg_messages row as JSON: the payload as text when it is UTF-8, and always
    as base64; properties in their stored form (bytes as {"$b64": ...}, some floats as
    {"$f": ...})."""
    payload = bytes(row.pop("payload"))
    try:
        text: str | None = payload.decode()
    except UnicodeDecodeError:
        text = None
    return {**row, "payload": text, "payload_b64": base64.b64encode(payload).decode()}


class AdminServer:
    """Implements protocols.sink.Listener so the gateway starts it like the others."""

    name = "http"

    def __init__(
        self,
        broker: Broker,
        store: SqlStore,
        *,
        ports: Mapping[str, int] | None = None,
        connections: HttpConnections | None = None,
    ) -> None:
        self.broker = broker
        self.store = store
        # Shared by the gateway's HTTP servers (gateway/http_server.py).
        self.connections = connections or HttpConnections(
            broker.config.max_http_connections, broker.config.login_timeout
        )
        self.stats = HttpStats()
        # The gateway's bound ports by listener, filled in as its listeners start.
        self._ports = ports if ports is not None else {}
        self._contract = RequestContract(openapi_document(package_version()))
        app = web.Application(
            # The body is read once the sender is authenticated: a refused peer cannot
            # make the gateway hold max_http_connections bodies of MAX_BODY.
            middlewares=[
                json_errors,
                same_origin,
                Guard(broker.access, broker.config).authenticate,
                read_body(broker.config.http_body_timeout),
            ],
            client_max_size=MAX_BODY,
        )
        app.add_routes(
            [
                web.get("/", self._console),
                web.static("/console", STATIC_DIR),
                web.get("/healthz", self._health),
                web.get("/metrics", self._metrics),
                web.get("/api/openapi.json", self._openapi),
                web.get("/api/status", self._status),
                web.get("/api/queues", self._list),
                web.post("/api/queues", self._create),
                web.get("/api/queues/{name}", self._show),
                web.patch("/api/queues/{name}", self._alter),
                web.delete("/api/queues/{name}", self._delete),
                web.post("/api/queues/{name}/purge", self._purge),
                web.post("/api/queues/{name}/redrive", self._redrive),
                web.get("/api/queues/{name}/inspect", self._inspect),
                web.get("/api/queues/{name}/groups", self._groups),
                web.post("/api/queues/{name}/groups", self._create_group),
                web.delete("/api/queues/{name}/groups/{group}", self._delete_group),
                web.post("/api/queues/{name}/groups/{group}/reset", self._reset_group),
                web.post("/api/queues/{name}/groups/{group}/keys/{key}/release", self._release_key),
                web.get("/api/queues/{name}/messages", self._browse),
                web.post("/api/queues/{name}/messages", self._publish_queue),
                web.post("/api/topics/{topic:.+}/messages", self._publish_topic),
            ]
        )
        self.app = app
        self._runner = app_runner(app, self.connections)

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None) -> int:
        return await serve(self._runner, host, port, ssl_context, self.connections, self.stats)

    async def close(self) -> None:
        await self._runner.cleanup()

    async def _console(self, request: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC_DIR / "index.html")

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "role": "active"})

    async def _status(self, request: web.Request) -> web.Response:
        """Counts only the queues and groups the caller may monitor: every authenticated
        user may ask, and the whole gateway's numbers would tell one how many queues
        others have."""
        config = self.broker.config
        principal = _principal(request)
        visible = {
            q.name
            for q in self.broker.queues()
            if self.broker.access.may_monitor(principal, q.name)
        }
        return web.json_response(
            {
                "name": config.name,
                "role": "active",
                "version": package_version(),
                "python": platform.python_version(),
                "database": self.store.engine.dialect.name,
                "listeners": dict(self._ports),
                "queues": len(visible),
                "groups_loaded": sum(r.queue.name in visible for r in self.broker.runtimes()),
            }
        )

    async def _openapi(self, request: web.Request) -> web.Response:
        return web.json_response(openapi_document(package_version()))

    async def _metrics(self, request: web.Request) -> web.Response:
        self.broker.access.check_monitor_all(_principal(request))
        metrics = self.broker.metrics
        try:
            await metrics.refresh_oldest(self.store.oldest_waiting)
        except KeygateError as e:
            log.warning("/metrics: oldest message ages not refreshed (%s)", e)
        return web.Response(body=metrics.render(), content_type="text/plain")

    async def _list(self, request: web.Request) -> web.Response:
        principal = _principal(request)
        visible = [
            q for q in self.broker.queues() if self.broker.access.may_monitor(principal, q.name)
        ]
        return web.json_response(await queue_summaries(self.store, visible))

    async def _create(self, request: web.Request) -> web.Response:
        body = await self._contract.body(request)
        exist_ok = body.pop("exist_ok", False)
        given = [k for k in body if k not in ("name", "subscriptions")]
        queue = await self.broker.declare(
            _principal(request), queue_from_json(body), exist_ok=exist_ok, given=given
        )
        return web.json_response(queue_json(queue), status=201)

    async def _show(self, request: web.Request) -> web.Response:
        self.broker.access.check_monitor(_principal(request), request.match_info["name"])
        queue = self.broker.queue(request.match_info["name"])
        return web.json_response(await queue_summary(self.store, queue))

    async def _alter(self, request: web.Request) -> web.Response:
        changes = queue_settings(await self._contract.body(request))
        self.broker.access.check_admin(_principal(request))
        name = self.broker.queue(request.match_info["name"]).name
        queue = await self.broker.alter_queue(name, **changes)
        return web.json_response(queue_json(queue))

    async def _delete(self, request: web.Request) -> web.Response:
        count = await self.broker.delete_queue(_principal(request), request.match_info["name"])
        return web.json_response({"deleted": request.match_info["name"], "messages": count})

    async def _purge(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        count = await self.broker.purge_queue(_principal(request), name)
        return web.json_response({"purged": name, "messages": count})

    async def _inspect(self, request: web.Request) -> web.Response:
        self.broker.access.check_monitor(_principal(request), request.match_info["name"])
        return web.json_response(
            await inspect_queue(self.broker, self.store, request.match_info["name"])
        )

    async def _groups(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        self.broker.access.check_monitor(_principal(request), name)
        self.broker.queue(name)
        groups = await self.store.list_groups(name)
        return web.json_response([group_json(g) for g in groups])

    def _group_of(self, request: web.Request) -> tuple[str, str]:
        """The queue and group a route names, the queue looked up first: under a missing
        queue every group route answers queue-not-found, and a group name no group can
        have is invalid-argument before it reaches the database."""
        name = request.match_info["name"]
        self.broker.queue(name)
        return name, validate_name("group", request.match_info["group"])

    async def _create_group(self, request: web.Request) -> web.Response:
        body = await self._contract.body(request)
        name = request.match_info["name"]
        self.broker.access.check_admin(_principal(request))
        config = group_from_json(name, body, self.broker.default_mode(name))
        group = await self.broker.create_group(config)
        return web.json_response(group_json(group), status=201)

    async def _delete_group(self, request: web.Request) -> web.Response:
        self.broker.access.check_admin(_principal(request))
        name, group = self._group_of(request)
        await self.broker.delete_group(name, group)
        return web.json_response({"deleted": group, "queue": name})

    async def _redrive(self, request: web.Request) -> web.Response:
        body = await self._contract.body(request)
        result = await group_ops.redrive(
            self.broker,
            self.store,
            _principal(request),
            request.match_info["name"],
            to=body.get("to"),
            key=body.get("key"),
            limit=body.get("limit"),
        )
        return web.json_response(result)

    async def _reset_group(self, request: web.Request) -> web.Response:
        body = await self._contract.body(request)
        self.broker.access.check_admin(_principal(request))
        name, group = self._group_of(request)
        target = ResetPosition.parse(body["to"])
        positions = await group_ops.reset_group(
            self.broker, self.store, name, group, target, force=body.get("force", False)
        )
        return web.json_response(
            {"queue": name, "group": group, "committed": {str(p): s for p, s in positions.items()}}
        )

    async def _release_key(self, request: web.Request) -> web.Response:
        body = await self._contract.body(request) if request.body_exists else {}
        self.broker.access.check_admin(_principal(request))
        name, group = self._group_of(request)
        key = request.match_info["key"]
        skip = body.get("skip", False)
        partitions = await group_ops.release_key(
            self.broker, self.store, name, group, key, skip=skip
        )
        return web.json_response(
            {"queue": name, "group": group, "key": key, "partitions": partitions, "skip": skip}
        )

    async def _browse(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        # Permission first: a user without it learns nothing of which queues exist.
        self.broker.access.authorize(_principal(request), "consume", name)
        queue = self.broker.queue(name)
        partition = self._contract.query_int(request, "partition")
        if partition is not None and partition >= queue.slots:
            raise InvalidArgument(f"partition {partition} out of range 0..{queue.slots - 1}")
        from_seq = self._contract.query_int(request, "from_seq")
        limit = self._contract.query_int(request, "limit")
        assert from_seq is not None and limit is not None  # both have documented defaults
        rows = await self.store.browse(name, partition=partition, from_seq=from_seq, limit=limit)
        return web.json_response([browsed_json(row) for row in rows])

    async def _publish(
        self, request: web.Request, *, queue: str | None = None, topic: str | None = None
    ) -> web.Response:
        body = await self._contract.body(request)
        publication = publication_from_json(body, queue=queue, topic=topic)
        receipt = await self.broker.publish(_principal(request), publication)
        return web.json_response(
            {"message_ids": list(receipt.message_ids), "queues": list(receipt.queues)},
            status=201,
        )

    async def _publish_queue(self, request: web.Request) -> web.Response:
        return await self._publish(request, queue=request.match_info["name"])

    async def _publish_topic(self, request: web.Request) -> web.Response:
        return await self._publish(request, topic=request.match_info["topic"])
