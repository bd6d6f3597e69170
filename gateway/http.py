"""The admin HTTP API (JSON) and ``/metrics`` (Prometheus text format).

    GET    /healthz                         liveness and role (a standby answers 503)
    GET    /metrics                         Prometheus metrics
    GET    /api/queues                      every queue with its settings and stats
    POST   /api/queues                      create: {"name": ..., "partitions": ..., ...}
    GET    /api/queues/{name}               one queue, its settings and stats
    PATCH  /api/queues/{name}               alter settings
    DELETE /api/queues/{name}               delete (messages, groups, offsets)
    POST   /api/queues/{name}/purge         drop every message, keep settings and groups
    GET    /api/queues/{name}/inspect       groups, partitions and flows (PAI-EAS style)
    GET    /api/queues/{name}/groups        the queue's consumer groups and their settings
    POST   /api/queues/{name}/groups        create: {"name": ..., "mode": ..., "key_order": ...,
                                            "start": ..., "tags": {...}, "ack_timeout": ...}
    DELETE /api/queues/{name}/groups/{group}  delete a group and its progress
    POST   /api/queues/{name}/messages      publish: {"payload": str | "payload_b64": str,
                                            "key": ..., "properties": {...}}
    POST   /api/topics/{topic}/messages     publish to a topic (same body)

Errors are ``{"error": code, "message": text}`` with the KeygateError's HTTP status.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import asdict, fields
from typing import Any, Final

from aiohttp import web

from core.errors import AuthenticationFailed, InvalidArgument, KeygateError
from core.model import (
    GroupConfig,
    GroupMode,
    KeyOrder,
    Publication,
    QueueConfig,
    StartPosition,
)
from gateway.broker import Broker
from gateway.inspect import inspect_queue, queue_summary
from protocols.sink import Principal

log = logging.getLogger("keygate.http")

_QUEUE_FIELDS = {f.name for f in fields(QueueConfig)}
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def queue_json(queue: QueueConfig) -> dict[str, Any]:
    data = asdict(queue)
    data["subscriptions"] = list(queue.subscriptions)
    data["dead_letter_queue"] = queue.dlq_name
    return data


def queue_from_json(body: dict[str, Any]) -> QueueConfig:
    unknown = set(body) - _QUEUE_FIELDS
    if unknown:
        raise InvalidArgument(f"unknown queue settings: {', '.join(sorted(unknown))}")
    if "name" not in body:
        raise InvalidArgument("a queue needs a name")
    values = dict(body)
    values["subscriptions"] = tuple(values.get("subscriptions") or ())
    try:
        return QueueConfig(**values)
    except TypeError as e:
        raise InvalidArgument(str(e)) from e


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
    unknown = set(body) - {"name", "mode", "key_order", "start", "tags", "ack_timeout"}
    if unknown:
        raise InvalidArgument(f"unknown group settings: {', '.join(sorted(unknown))}")
    if "name" not in body:
        raise InvalidArgument("a group needs a name")
    tags = body.get("tags") or None
    if tags is not None and not (
        isinstance(tags, dict) and all(isinstance(v, str) for v in tags.values())
    ):
        raise InvalidArgument("tags must be an object of strings")
    try:
        return GroupConfig(
            queue,
            body["name"],
            GroupMode(body.get("mode", default_mode)),
            KeyOrder(body.get("key_order", KeyOrder.PARTITION)),
            StartPosition(body.get("start", StartPosition.EARLIEST)),
            tags,
            body.get("ack_timeout"),
        )
    except ValueError as e:
        raise InvalidArgument(str(e)) from e


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except KeygateError as e:
        response = web.json_response({"error": e.code, "message": e.message}, status=e.status)
        if isinstance(e, AuthenticationFailed):
            response.headers["WWW-Authenticate"] = 'Basic realm="keygate"'
        return response


PRINCIPAL: Final = web.RequestKey("principal", Principal)


def _principal(request: web.Request) -> Principal:
    return request[PRINCIPAL]


async def _body(request: web.Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InvalidArgument(f"the request body is not JSON: {e}") from e
    if not isinstance(body, dict):
        raise InvalidArgument("the request body must be a JSON object")
    return body


class AdminServer:
    """Implements protocols.sink.Listener so the gateway starts it like the others."""

    name = "http"

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        app = web.Application(
            middlewares=[_errors, self._authenticate], client_max_size=64 * 1024 * 1024
        )
        app.add_routes(
            [
                web.get("/healthz", self._health),
                web.get("/metrics", self._metrics),
                web.get("/api/queues", self._list),
                web.post("/api/queues", self._create),
                web.get("/api/queues/{name}", self._show),
                web.patch("/api/queues/{name}", self._alter),
                web.delete("/api/queues/{name}", self._delete),
                web.post("/api/queues/{name}/purge", self._purge),
                web.get("/api/queues/{name}/inspect", self._inspect),
                web.get("/api/queues/{name}/groups", self._groups),
                web.post("/api/queues/{name}/groups", self._create_group),
                web.delete("/api/queues/{name}/groups/{group}", self._delete_group),
                web.post("/api/queues/{name}/messages", self._publish_queue),
                web.post("/api/topics/{topic:.+}/messages", self._publish_topic),
            ]
        )
        self._runner = web.AppRunner(app, access_log=None)
        self._site: web.TCPSite | None = None

    @web.middleware
    async def _authenticate(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """HTTP Basic credentials, checked like every protocol's, once users are configured
        (``/healthz`` stays open for probes)."""
        if not self.broker.config.users or request.path == "/healthz":
            request[PRINCIPAL] = Principal(None, "http")
            return await handler(request)
        scheme, _, encoded = request.headers.get("Authorization", "").partition(" ")
        try:
            username, sep, password = (
                base64.b64decode(encoded, validate=True).decode().partition(":")
            )
        except (binascii.Error, UnicodeDecodeError):
            sep = ""
        if scheme.lower() != "basic" or not sep:
            raise AuthenticationFailed("HTTP Basic credentials required")
        request[PRINCIPAL] = await self.broker.authenticate(
            username, password, protocol="http", client_id=None
        )
        return await handler(request)

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None) -> int:
        await self._runner.setup()
        self._site = web.TCPSite(self._runner, host, port, ssl_context=ssl_context)
        await self._site.start()
        return int(self._runner.addresses[0][1])

    async def close(self) -> None:
        await self._runner.cleanup()

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "role": "active"})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.broker.metrics.render(), content_type="text/plain")

    async def _list(self, request: web.Request) -> web.Response:
        out = [await queue_summary(self.broker, q) for q in self.broker.queues()]
        return web.json_response(out)

    async def _create(self, request: web.Request) -> web.Response:
        body = await _body(request)
        exist_ok = bool(body.pop("exist_ok", False))
        queue = await self.broker.declare(
            _principal(request), queue_from_json(body), exist_ok=exist_ok
        )
        return web.json_response(queue_json(queue), status=201)

    async def _show(self, request: web.Request) -> web.Response:
        queue = self.broker.queue(request.match_info["name"])
        return web.json_response(await queue_summary(self.broker, queue))

    async def _alter(self, request: web.Request) -> web.Response:
        body = await _body(request)
        unknown = set(body) - _QUEUE_FIELDS
        if unknown:
            raise InvalidArgument(f"unknown queue settings: {', '.join(sorted(unknown))}")
        if "subscriptions" in body:
            body["subscriptions"] = tuple(body["subscriptions"])
        self.broker.check_admin(_principal(request))
        queue = await self.broker.alter_queue(request.match_info["name"], **body)
        return web.json_response(queue_json(queue))

    async def _delete(self, request: web.Request) -> web.Response:
        count = await self.broker.delete_queue(_principal(request), request.match_info["name"])
        return web.json_response({"deleted": request.match_info["name"], "messages": count})

    async def _purge(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        count = await self.broker.purge_queue(_principal(request), name)
        return web.json_response({"purged": name, "messages": count})

    async def _inspect(self, request: web.Request) -> web.Response:
        return web.json_response(await inspect_queue(self.broker, request.match_info["name"]))

    async def _groups(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        self.broker.queue(name)
        groups = await self.broker.store.list_groups(name)
        return web.json_response([group_json(g) for g in groups])

    async def _create_group(self, request: web.Request) -> web.Response:
        body = await _body(request)
        name = request.match_info["name"]
        self.broker.check_admin(_principal(request))
        config = group_from_json(name, body, self.broker.default_mode(name))
        group = await self.broker.create_group(config)
        return web.json_response(group_json(group), status=201)

    async def _delete_group(self, request: web.Request) -> web.Response:
        name, group = request.match_info["name"], request.match_info["group"]
        self.broker.check_admin(_principal(request))
        await self.broker.delete_group(name, group)
        return web.json_response({"deleted": group, "queue": name})

    async def _publish(
        self, request: web.Request, *, queue: str | None = None, topic: str | None = None
    ) -> web.Response:
        body = await _body(request)
        if "payload_b64" in body:
            try:
                payload = base64.b64decode(body["payload_b64"], validate=True)
            except (binascii.Error, TypeError) as e:
                raise InvalidArgument(f"payload_b64 is not base64: {e}") from e
        else:
            payload = str(body.get("payload", "")).encode()
        properties = body.get("properties") or {}
        if not isinstance(properties, dict):
            raise InvalidArgument("properties must be an object")
        publication = Publication(
            payload=payload,
            key=body.get("key"),
            properties=properties,
            ttl=body.get("ttl"),
            producer="http",
            dedup_id=body.get("dedup_id"),
            content_type=body.get("content_type"),
            queue=queue,
            topic=topic,
        )
        receipt = await self.broker.publish(_principal(request), publication)
        return web.json_response(
            {"message_ids": list(receipt.message_ids), "queues": list(receipt.queues)},
            status=201,
        )

    async def _publish_queue(self, request: web.Request) -> web.Response:
        return await self._publish(request, queue=request.match_info["name"])

    async def _publish_topic(self, request: web.Request) -> web.Response:
        return await self._publish(request, topic=request.match_info["topic"])
