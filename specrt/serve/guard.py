"""What a request must pass before FastAPI sees it: pure ASGI middleware, outermost first.

    AllowedHosts   the Host header names this server (DNS rebinding: a web page whose
                   domain resolves to 127.0.0.1 sends its own domain as Host)   -> 400
    (CORS)         starlette's CORSMiddleware, only with --cors-origin
    ApiKey         `Authorization: Bearer KEY`: the scheme in any letter case (RFC 7235),
                   the key exactly, compared in constant time; /health stays
                   open for load balancers                                        -> 401
    BodyLimit      the body is read here, at most `max_bytes` of it, and replayed to
                   the app (FastAPI buffers JSON bodies anyway)                   -> 413

Every refusal is an OpenAI-style error body, like the app's own.
"""
from __future__ import annotations

import hmac
import ipaddress
import json
import socket

from specrt.serve.protocol import error_body

LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")
OPEN_PATHS = ("/health",)       # answered without the API key


async def _refuse(send, status: int, message: str, code: str, headers: tuple = ()) -> None:
    body = json.dumps(error_body(message, "invalid_request_error", None, code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close"), *headers]})
    await send({"type": "http.response.body", "body": body})


def _header(scope, name: bytes) -> bytes | None:
    for k, v in scope["headers"]:
        if k == name:
            return v
    return None


def default_hosts(host: str) -> tuple[str, ...]:
    """The Host names a server bound to `host` answers to by default: the bound address and
    the local names; bound to every interface (0.0.0.0, ::), also this machine's names.
    IP literals bound to every interface are accepted in AllowedHosts itself."""
    names = {host.strip("[]"), *LOCAL_NAMES}
    if host in ("0.0.0.0", "::", ""):
        names |= {socket.gethostname(), socket.getfqdn()}
    return tuple(sorted(n.lower() for n in names if n))


def host_name(value: str) -> str:
    """'example.com:8000' -> 'example.com'; '[::1]:8000' -> '::1'."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


class AllowedHosts:
    def __init__(self, app, *, hosts: tuple[str, ...], any_ip: bool, hint: str):
        self.app, self.any_ip, self.hint = app, any_ip, hint
        self.any = "*" in hosts
        self.exact = {h.lower() for h in hosts if not h.startswith("*.")}
        self.suffixes = tuple(h.lower()[1:] for h in hosts if h.startswith("*."))

    def allowed(self, name: str) -> bool:
        if self.any or name in self.exact or (self.suffixes and name.endswith(self.suffixes)):
            return True
        if self.any_ip:     # DNS rebinding needs a domain name: an IP literal cannot be rebound
            try:
                ipaddress.ip_address(name)
                return True
            except ValueError:
                return False
        return False

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or self.any:
            return await self.app(scope, receive, send)
        raw = _header(scope, b"host")
        name = host_name(raw.decode("latin-1")) if raw else ""
        if not self.allowed(name):
            return await _refuse(send, 400, f"Host header {name!r} is not a name this server answers to (a guard "
                                 f"against DNS rebinding): call it as {self.hint}, or start it with "
                                 f"--allowed-hosts {name or 'NAME'}", "invalid_host")
        return await self.app(scope, receive, send)


class ApiKey:
    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode("utf-8")

    def valid(self, given: bytes) -> bool:
        """`Bearer KEY`: RFC 7235 makes the scheme's name case-insensitive and lets one or more
        spaces follow it; the key itself must be exact (letter case, no whitespace around it)."""
        scheme, _, key = given.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(key.lstrip(b" "), self.key)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or scope["method"] == "OPTIONS":
            return await self.app(scope, receive, send)
        given = _header(scope, b"authorization") or b""
        if not self.valid(given):
            what = "no API key was sent" if not given else "the API key is not valid"
            return await _refuse(send, 401, f"{what}: send the server's key as the header 'Authorization: Bearer "
                                 "KEY' (the OpenAI clients' api_key); the server was started with --api-key or "
                                 "SPECRT_API_KEY", "invalid_api_key", ((b"www-authenticate", b"Bearer"),))
        return await self.app(scope, receive, send)


class BodyLimit:
    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    def _too_large(self, send, n: int | str):
        return _refuse(send, 413, f"the request body is {n} bytes; this server takes at most {self.max_bytes} "
                       "(--max-body-bytes): send a shorter prompt", "request_too_large")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._too_large(send, int(declared))
        chunks, size = [], 0
        while True:                      # read the whole body, never more than max_bytes of it
            message = await receive()
            if message["type"] != "http.request":     # the client left while sending
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._too_large(send, f"more than {self.max_bytes}")
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()       # after the body: http.disconnect when the client leaves

        return await self.app(scope, replay, send)
