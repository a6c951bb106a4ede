"""What `make mutation` found untested in specrt/serve/guard.py (its surviving mutants): the
refusal's OpenAI error shape and headers, host matching (any host, wildcard suffixes, letter
case), the names a server bound to every interface answers to, and OPTIONS passing the API
key check. The live-server tests build the guard once per module, so mutmut checks a mutant
of its constructor only against the first test of that module; these build it in each test.

Pure ASGI calls with a recording app: no engines, no sockets."""
from __future__ import annotations

import asyncio
import json
import socket

import pytest

from specrt.serve.guard import LOCAL_NAMES, AllowedHosts, ApiKey, BodyLimit, default_hosts


class App:
    """The app behind a guard: answers 200 and records the requests that reached it."""

    def __init__(self):
        self.paths: list[str] = []

    async def __call__(self, scope, receive, send):
        self.paths.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def call(app, *, host: str | None = "127.0.0.1", method="GET", path="/v1/models", headers=(), body=b""):
    """One request through `app`: (status, {header name: value}, body)."""
    raw = ([(b"host", host.encode())] if host is not None else []) + [(k.encode(), v.encode()) for k, v in headers]
    scope = {"type": "http", "method": method, "path": path, "headers": raw}
    sent = []

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    start = sent[0]
    names = [k.decode("latin-1") for k, _ in start["headers"]]
    assert names == [n.lower() for n in names], f"ASGI response header names must be lowercase: {names}"
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, \
        b"".join(m.get("body", b"") for m in sent[1:])


REFUSALS = {   # guard -> (request, status, code)
    "host": (lambda: AllowedHosts(App(), hosts=("api.example",), any_ip=False, hint="h"),
             {"host": "evil.example"}, 400, "invalid_host"),
    "key": (lambda: ApiKey(App(), "s3cret"), {"headers": (("authorization", "Bearer wrong"),)}, 401, "invalid_api_key"),
    "body": (lambda: BodyLimit(App(), 8), {"method": "POST", "body": b"x" * 9}, 413, "request_too_large"),
}


@pytest.mark.parametrize("guard", list(REFUSALS))
def test_a_refusal_is_an_openai_error_body_of_its_stated_length_on_a_closed_connection(guard):
    make, request, status, code = REFUSALS[guard]
    got, headers, body = call(make(), **request)
    assert got == status
    assert headers["content-type"].lower() == "application/json"
    assert int(headers["content-length"]) == len(body)
    assert headers["connection"].lower() == "close"     # a refused body may be unread: never reuse the connection
    error = json.loads(body)["error"]
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", code, None)


def test_a_star_answers_every_host():
    assert call(AllowedHosts(App(), hosts=("*",), any_ip=False, hint="h"), host="anything.example")[0] == 200


def test_hosts_match_in_any_letter_case_and_a_wildcard_only_below_its_domain():
    app = App()
    guard = AllowedHosts(app, hosts=("API.Example", "*.Corp.Example"), any_ip=False, hint="h")
    for host in ("api.example", "API.EXAMPLE:8000", "x.corp.example", "a.b.CORP.example"):
        assert call(guard, host=host)[0] == 200, host
    for host in ("corp.example", "evilcorp.example", "api.example.evil", "10.1.2.3", ""):
        assert call(guard, host=host)[0] == 400, host
    assert len(app.paths) == 4


def test_ip_literals_are_answered_only_when_bound_to_every_interface():
    for any_ip, status in ((True, 200), (False, 400)):
        guard = AllowedHosts(App(), hosts=("api.example",), any_ip=any_ip, hint="h")
        assert [call(guard, host=h)[0] for h in ("10.1.2.3", "[fe80::1]:80")] == [status, status]
        assert call(guard, host="evil.example")[0] == 400


def test_a_server_bound_to_one_address_answers_to_it_and_the_local_names_only():
    assert default_hosts("127.0.0.1") == tuple(sorted(LOCAL_NAMES))
    assert default_hosts("[::1]") == tuple(sorted(LOCAL_NAMES))
    assert default_hosts("192.168.1.7") == tuple(sorted({"192.168.1.7", *LOCAL_NAMES}))


@pytest.mark.parametrize("host", ["0.0.0.0", "::", ""])
def test_a_server_bound_to_every_interface_answers_to_this_machines_names_too(host):
    names = set(default_hosts(host))
    assert {*LOCAL_NAMES, socket.gethostname().lower(), socket.getfqdn().lower()} <= names
    assert names == {n.lower() for n in names}


def test_options_requests_pass_the_api_key_check_and_others_do_not():
    app = App()
    guard = ApiKey(app, "s3cret")
    assert call(guard, method="OPTIONS", path="/v1/completions")[0] == 200
    assert call(guard, method="POST", path="/v1/completions")[0] == 401
    assert app.paths == ["/v1/completions"]
