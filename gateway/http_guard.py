"""What a request to the gateway's admin HTTP port passes before its handler runs — on the
active gateway (gateway/http.py) and on a standby (gateway/standby.py) alike: errors as
JSON, the cross-site check, the Host check and authentication.

How it works. ``json_errors`` turns every refusal, aiohttp's own (an unknown path or
method) included, into ``{"error": code, "message": text}``. ``same_origin`` refuses
requests that change something and that a page of another site may have sent (cross-site
request forgery). ``Guard.authenticate`` puts the caller's ``Principal`` on the request,
after two checks:

- **The Host** (DNS rebinding). A page on ``evil.example`` whose name the attacker then
  points at 127.0.0.1 is, to the browser, same-origin with the gateway's answers: it can
  read them and send any header, Origin and Authorization included. Without users every
  request from loopback is anonymous with every right, so the page would have them. So
  while the gateway has no users it answers only requests whose Host is ``localhost``, an
  IP address (an address cannot be rebound: the page's origin is the address itself), the
  name it binds (``host``) or a name in ``http_allowed_hosts``. With users, credentials are
  checked and a rebinding page has none (a browser keeps the console's Basic credentials
  for the console's own origin), so any name is served: behind a reverse proxy, or on
  ``0.0.0.0`` reached by any of the host's names, nothing needs configuring.
- **The credentials**: HTTP Basic or a client certificate, checked like every protocol's.

``/healthz`` skips both: probes call it under any name and it tells nothing.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
from collections.abc import Awaitable, Callable
from typing import Final

from aiohttp import hdrs, web

from core.errors import AuthenticationFailed, InvalidArgument, KeygateError, PermissionDenied
from gateway.access import Access
from gateway.config import GatewayConfig
from protocols.sink import Principal, peer_identity

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

PRINCIPAL: Final = web.RequestKey("principal", Principal)
_SAFE_METHODS: Final = frozenset({"GET", "HEAD", "OPTIONS"})
_OPEN_PATHS: Final = frozenset({"/healthz"})


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        code = e.reason.lower().replace(" ", "-")
        return web.json_response({"error": code, "message": e.reason}, status=e.status)
    except KeygateError as e:
        response = web.json_response({"error": e.code, "message": e.message}, status=e.status)
        if isinstance(e, AuthenticationFailed):
            response.headers["WWW-Authenticate"] = 'Basic realm="keygate"'
        return response


@web.middleware
async def same_origin(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Refuse a request that changes something when a browser may have sent it from
    another site (cross-site request forgery: a browser attaches the HTTP Basic
    credentials it cached for the console): one whose Origin is not this server, or whose
    body is not JSON (a form or text/plain body is what a cross-site page can send without
    asking). The CLI and other programs send neither an Origin nor another body type."""
    if request.method not in _SAFE_METHODS:
        origin = request.headers.get("Origin")
        if origin is not None and origin != f"{request.scheme}://{request.host}":
            raise PermissionDenied("cross-site requests may not change anything")
        if request.can_read_body and request.content_type != "application/json":
            raise InvalidArgument("a request body must be application/json")
    return await handler(request)


def host_name(host: str) -> str:
    """The name or address of a Host header, without its port or brackets, lower-case."""
    if host.startswith("["):
        return host[1:].partition("]")[0].lower()
    name, colon, port = host.rpartition(":")
    return (name if colon and port.isdigit() else host).lower()


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class Guard:
    """The Host check and authentication of one gateway's admin port (module doc)."""

    def __init__(self, access: Access, config: GatewayConfig) -> None:
        self._access = access
        self._anonymous = not config.users
        self._names = frozenset(
            name.lower() for name in ("localhost", config.host, *config.http_allowed_hosts)
        )

    def served_under(self, host: str | None) -> bool:
        """Whether an anonymous request with this Host header may be answered (a request
        without one comes from no browser)."""
        if host is None:
            return True
        name = host_name(host)
        return name in self._names or _is_address(name)

    @web.middleware
    async def authenticate(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in _OPEN_PATHS:
            request[PRINCIPAL] = Principal(None, "http")
            return await handler(request)
        host = request.headers.get(hdrs.HOST)
        if self._anonymous and not self.served_under(host):
            raise PermissionDenied(
                f"not served under the name {host_name(host or '')!r} without users: only "
                "localhost, IP addresses, the host it binds and http_allowed_hosts "
                "(a page elsewhere could otherwise reach it by DNS rebinding)"
            )
        username = password = None
        if "Authorization" in request.headers:
            scheme, _, encoded = request.headers["Authorization"].partition(" ")
            try:
                username, sep, password = (
                    base64.b64decode(encoded, validate=True).decode().partition(":")
                )
            except (binascii.Error, UnicodeDecodeError):
                sep = ""
            if scheme.lower() != "basic" or not sep:
                raise AuthenticationFailed("HTTP Basic credentials required")
        peer, certificate_user = (
            (None, None) if request.transport is None else peer_identity(request.transport)
        )
        user = await self._access.auth.authenticate(
            username, password, peer=peer, certificate_user=certificate_user
        )
        request[PRINCIPAL] = Principal(user, "http")
        return await handler(request)


__all__ = ["PRINCIPAL", "Guard", "host_name", "json_errors", "same_origin"]
