"""Who may use the server: the API key (``Authorization: Bearer <key>``, compared in constant
time) and the ``Host`` check that keeps a loopback-bound server without a key from web pages
(DNS rebinding)."""

from __future__ import annotations

import hmac
import ipaddress
from typing import Any, Sequence

from fastapi import Request
from fastapi.responses import JSONResponse

from .errors import OpenAIError

__all__ = ["LOCAL_HOSTS", "default_allowed_hosts", "HostCheck", "check_api_key"]

#: ``Host`` names a loopback-bound server without an API key accepts by default.
LOCAL_HOSTS = ("localhost", "127.0.0.1", "[::1]")


def check_api_key(request: Request, api_key: str | None) -> None:
    """Raise OpenAIError 401 unless the request sends ``Authorization: Bearer <api_key>``
    (the scheme in any case; the key compared in constant time; no check when the server
    has no key)."""
    if api_key is None:
        return
    scheme, _, token = request.headers.get("authorization", "").strip().partition(" ")
    if not (scheme.lower() == "bearer"
            and hmac.compare_digest(token.strip().encode("utf-8"), api_key.encode("utf-8"))):
        raise OpenAIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                          type="authentication_error", code="invalid_api_key")


def default_allowed_hosts(bind_host: str, api_key: str | None) -> list[str] | None:
    """The ``Host`` names ``serve`` accepts unless told: for a loopback bind without an API key
    (a web page the user visits could otherwise reach the server through DNS rebinding and read
    its answers), :data:`LOCAL_HOSTS` and the bind address itself (``127.0.0.2``; an IPv6 one
    bracketed, ``[::1]``, as it is written in a URL and a ``Host`` header), so the URL ``serve``
    prints is answered; else any (None)."""
    if api_key is not None:
        return None
    host = bind_host.strip().strip("[]")
    try:
        addr = ipaddress.ip_address(host) if host.lower() != "localhost" else None
        local = addr is None or addr.is_loopback
    except ValueError:
        return None
    if not local:
        return None
    hosts = list(LOCAL_HOSTS)
    if addr is not None:  # the address as given and as printed (compressed: 0:0:0:0:0:0:0:1 is ::1)
        for text in (host.lower(), addr.compressed):
            name = f"[{text}]" if addr.version == 6 else text
            if name not in hosts:
                hosts.append(name)
    return hosts


def _host_name(host: str) -> str:
    """``example.com:8000`` -> ``example.com``; ``[::1]:8000`` -> ``[::1]``; lower case."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[: host.find("]") + 1] if "]" in host else host
    if host.count(":") > 1:  # a bare IPv6 address
        return f"[{host}]"
    return host.split(":", 1)[0]


class HostCheck:
    """ASGI middleware: refuse (400) an HTTP request whose ``Host`` header is not one of
    ``hosts`` (names, ``[v6]`` addresses; any port)."""

    def __init__(self, app: Any, hosts: Sequence[str]):
        self.app = app
        self.hosts = frozenset(_host_name(h) for h in hosts)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            host = ""
            for k, v in scope["headers"]:
                if k == b"host":
                    host = v.decode("latin-1")
                    break
            if _host_name(host) not in self.hosts:
                e = OpenAIError(400, f"the Host header {host[:100]!r} is not allowed: this server answers "
                                f"{', '.join(sorted(self.hosts))} (serve --allowed-hosts)", code="host_not_allowed")
                await JSONResponse(e.body(), status_code=400)(scope, receive, send)
                return
        await self.app(scope, receive, send)
