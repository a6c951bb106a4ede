"""What a request must pass before a worker sees it, in both server modes (one-request and
--max-num-seqs): the body limit over the running total of a chunked body, the API key compared
exactly, and one 400 (code "invalid_json") for every body that is not one JSON object.

The app is driven in-process through raw ASGI calls: each body piece is one `http.request`
message, as a server delivers a chunked upload, so the pieces the guard reads are counted
exactly. Refusals never reach a worker, so the pools are never started."""
from __future__ import annotations

import asyncio
import json

import pytest

from specrt.serve.server import ServeConfig, build_app, guarded

KEY = "s3cret-Key"
LIMIT = 4096
MODES = {"one-request": {}, "batched": {"max_num_seqs": 2}}


@pytest.fixture(scope="module", params=list(MODES))
def app(request, tiny_self_engines, tiny_batch_engines):
    engines = tiny_batch_engines if request.param == "batched" else tiny_self_engines
    app, _ = build_app(ServeConfig(str(engines), api_key=KEY, **MODES[request.param]))    # 1 MiB body limit
    return app


class Reply:
    def __init__(self):
        self.status, self.headers, self.body, self.read = None, {}, b"", 0

    def json(self) -> dict:
        return json.loads(self.body)


def call(app, path: str = "/v1/completions", pieces=(b"{}",), *, method: str = "POST",
         auth: bytes | None = b"Bearer " + KEY.encode(), headers: tuple = ()) -> Reply:
    """One request through `app`; its body arrives as `pieces`, one ASGI message each (no
    content-length: a chunked upload). `Reply.read` counts the pieces the app asked for."""
    out, pieces = Reply(), list(pieces)
    hdrs = [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json"), *headers]
    if auth is not None:
        hdrs.append((b"authorization", auth))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
             "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": hdrs,
             "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 50000)}

    async def receive():
        if out.read < len(pieces):
            out.read += 1
            return {"type": "http.request", "body": pieces[out.read - 1], "more_body": out.read < len(pieces)}
        await asyncio.sleep(3600)       # the client stays connected; never reached by a finished request

    async def send(message):
        if message["type"] == "http.response.start":
            out.status = message["status"]
            out.headers = {k.decode(): v.decode() for k, v in message["headers"]}
        elif message["type"] == "http.response.body":
            out.body += message.get("body", b"")

    asyncio.run(asyncio.wait_for(app(scope, receive, send), 600))
    return out


def error_of(reply: Reply, status: int) -> dict:
    assert reply.status == status, (reply.status, reply.body)
    err = reply.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


# --------------------------------------------------------------------------- the body limit

class Recorder:
    """The app behind the guards: records each body it is handed."""

    def __init__(self):
        self.bodies: list[bytes] = []

    async def __call__(self, scope, receive, send):
        body, more = b"", True
        while more:
            m = await receive()
            body, more = body + m.get("body", b""), m.get("more_body", False)
        self.bodies.append(body)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def test_a_chunked_body_over_the_limit_in_small_pieces_is_413_and_never_reaches_the_app():
    inner = Recorder()
    app = guarded(inner, ServeConfig("x", max_body_bytes=LIMIT))
    pieces = [b"x" * 100] * 60                          # 6000 bytes, each piece far under the limit
    r = call(app, pieces=pieces, auth=None)
    assert error_of(r, 413)["code"] == "request_too_large"
    assert inner.bodies == []
    assert r.read == LIMIT // 100 + 1                   # stopped at the piece that crossed the limit


def test_a_chunked_body_of_exactly_the_limit_reaches_the_app_whole():
    inner = Recorder()
    app = guarded(inner, ServeConfig("x", max_body_bytes=LIMIT))
    pieces = [bytes([65 + i % 26]) * 64 for i in range(LIMIT // 64)]
    assert call(app, pieces=pieces, auth=None).status == 200
    assert inner.bodies == [b"".join(pieces)]


def test_both_server_modes_refuse_a_chunked_body_over_the_limit(app):
    limit = ServeConfig("x").max_body_bytes
    pieces = [b'{"prompt": "'] + [b"w" * 1000] * (limit // 1000 + 10) + [b'"}']
    r = call(app, pieces=pieces)
    assert error_of(r, 413)["code"] == "request_too_large" and r.read == limit // 1000 + 2


# --------------------------------------------------------------------------- the API key

WRONG_KEYS = {
    "lower-case": b"Bearer s3cret-key", "upper-case": b"Bearer S3CRET-KEY", "mixed-case": b"Bearer s3cret-KEY",
    "prefix": b"Bearer s3cret-Ke", "longer": b"Bearer s3cret-Key2", "suffix": b"Bearer xs3cret-Key",
    "trailing-space": b"Bearer s3cret-Key ", "trailing-tab": b"Bearer s3cret-Key\t",     # not the key's
    "leading-tab": b"Bearer \ts3cret-Key", "no-space": b"Bearers3cret-Key", "basic": b"Basic s3cret-Key",
    "no-scheme": b"s3cret-Key", "scheme-only": b"Bearer", "empty": b"",
}


@pytest.mark.parametrize("auth", list(WRONG_KEYS.values()), ids=list(WRONG_KEYS))
def test_only_the_exact_key_opens_the_api(app, auth):
    err = error_of(call(app, "/v1/models", method="GET", auth=auth), 401)
    assert err["code"] == "invalid_api_key"


@pytest.mark.parametrize("auth", [b"Bearer s3cret-Key", b"bearer s3cret-Key", b"BEARER  s3cret-Key"],
                         ids=["Bearer", "scheme-lower", "scheme-upper-two-spaces"])
def test_the_exact_key_opens_it_under_the_bearer_scheme_in_any_case(app, auth):
    """RFC 7235: the scheme's name is case-insensitive and one or more spaces follow it; the key is exact."""
    r = call(app, "/v1/models", method="GET", auth=auth)
    assert r.status == 200 and r.json()["object"] == "list"


# --------------------------------------------------------------------------- unparseable bodies

DEEP = b'{"prompt": "hi", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"   # past the parser's recursion


@pytest.mark.parametrize("body,says", [
    (b"{not json", "not valid JSON"),
    (b'{"prompt": "caf\xe9", "max_tokens": 2}', "not UTF-8"),                 # latin-1, not UTF-8
    (b'{"prompt": "\xff\xfe"}', "not UTF-8"),
    (b'{"prompt": "hi", "max_tokens": ' + b"1" * 5000 + b"}", "more than 4300 digits"),
    (b'{"prompt": [' + b"9" * 5000 + b"]}", "more than 4300 digits"),
    (b'{"prompt": "hi", "x": ' + b"[" * 65 + b"]" * 65 + b"}", "more than 64 levels deep"),
    (DEEP, "more than 64 levels deep"),
    (b'{"prompt": "hi", "temperature": NaN}', "NaN, which is not JSON"),
    (b'{"prompt": "hi", "x": Infinity}', "Infinity, which is not JSON"),
    (b'{"prompt": "hi", "x": -Infinity}', "-Infinity, which is not JSON"),
    (b'[{"prompt": "hi"}]', "JSON array, not an object"),
    (b'"hi"', "JSON string, not an object"),
    (b"null", "JSON null, not an object"),
    (b"3", "JSON number, not an object"),
    (b"", "not valid JSON"),
], ids=["malformed", "latin-1", "bad-bytes", "5000-digit-int", "5000-digit-id", "depth-65", "depth-100000", "NaN",
        "Infinity", "-Infinity", "array", "string", "null", "number", "empty"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_every_unparseable_body_is_the_same_400_saying_what_is_wrong(app, path, body, says):
    r = call(app, path, pieces=[body])
    err = error_of(r, 400)
    assert err == {"message": err["message"], "type": "invalid_request_error", "param": None, "code": "invalid_json"}
    assert err["message"].startswith("the request body ") and says in err["message"], err["message"]


def test_json_nested_as_deep_as_the_limit_is_parsed(app):
    """64 levels (the body object included) are a request like any other: here, one the model refuses by name."""
    body = b'{"model": "other", "prompt": "hi", "x": ' + b"[" * 63 + b"]" * 63 + b"}"
    err = error_of(call(app, pieces=[body]), 404)
    assert err["code"] == "model_not_found"
