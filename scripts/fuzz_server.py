"""Fuzz `specrt serve`'s request schema over loopback; bounded, it stops by itself.

    .venv/bin/python scripts/fuzz_server.py ENGINES [--cases N] [--seed S] [--max-num-seqs N] [--json FILE]

Starts `specrt serve ENGINES --port 0` (127.0.0.1; with --max-num-seqs N the batched server,
one engine decoding up to N requests together: ENGINES built with `specrt build --batch`;
without it the one-request-per-worker server), then sends N bodies to each of
/v1/completions and /v1/chat/completions drawn by hypothesis from `completion_bodies()`
/ `chat_bodies()`: valid requests (short generations, streamed or not), the same with one
field replaced by any JSON value, and bodies of anything: every known field with values of
its type and of every other JSON type, unknown fields, lone surrogates, NaN/Infinity, huge
integers, nested junk; and N raw bodies that are not JSON or not UTF-8. With schemathesis installed (the
`fuzz` extra) it then runs schemathesis's positive and negative cases from the OpenAPI
document the server serves (/openapi.json). Each answer must be a 2xx with a complete
body (a stream ends with `data: [DONE]`), a 4xx with an OpenAI-style error body, or the
server's own 504 for a generation past its --timeout (30 s here); any other 5xx, a
dropped connection or a broken answer is a finding. Reports cases, statuses and the server's RSS before
and after; stops the server with SIGTERM (it must exit 0). Exit status 1 on any finding.
"""
from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as fixed_seed
from hypothesis.errors import Unsatisfiable
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[1]     # the server runs this checkout's specrt
PATHS = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}

# --- what to send ---------------------------------------------------------------------
# text includes lone surrogates (category Cs), which JSON can carry as \ud800 escapes
text = st.text(st.characters(blacklist_categories=()), max_size=24)
scalar = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(), text)
junk = st.recursive(scalar, lambda c: st.lists(c, max_size=3) | st.dictionaries(text, c, max_size=3), max_leaves=6)


def _or_junk(s):
    return st.one_of(s, s, s, junk)        # mostly the right type, sometimes anything


_SAMPLING = {
    "model": _or_junk(st.sampled_from(["eng", "gpt-4", ""])),
    "max_tokens": _or_junk(st.integers(-2, 24)),
    "temperature": _or_junk(st.floats(-0.5, 2.5) | st.sampled_from([0.0, 1e-300, 5e-324, 2.0])),
    "top_p": _or_junk(st.floats(-0.1, 1.1)),
    "seed": _or_junk(st.integers(-1, 2**64)),
    "stop": _or_junk(text | st.lists(text, max_size=6)),
    "stream": _or_junk(st.booleans()),
    "stream_options": _or_junk(st.fixed_dictionaries({}, optional={"include_usage": _or_junk(st.booleans())})),
    "n": _or_junk(st.integers(0, 3)), "echo": junk, "best_of": junk, "suffix": junk,
    "presence_penalty": junk, "frequency_penalty": junk, "logit_bias": junk,
    "logprobs": _or_junk(st.integers(-1, 21) | st.booleans()), "top_logprobs": _or_junk(st.integers(-1, 21)),
    # structured outputs (runtime/grammar.py): valid, invalid and junk specs
    "response_format": _or_junk(st.sampled_from([{"type": "text"}, {"type": "json_object"}, {"type": "yaml"},
                                                 {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                                                     "type": "object", "properties": {"a": {"type": "integer"}}}}},
                                                 {"type": "json_schema", "json_schema": {"name": "x"}}])),
    "guided_regex": _or_junk(st.sampled_from(["[a-z]{1,8}", "[", "(yes|no)", ""])),
    "guided_choice": _or_junk(st.lists(text, max_size=3)), "grammar": junk, "structured_outputs": junk,
    "user": junk, "unknown_field": junk,
}
_PART = st.fixed_dictionaries({"type": _or_junk(st.just("text")), "text": _or_junk(text)})
_MESSAGE = st.fixed_dictionaries(
    {"role": _or_junk(st.sampled_from(["system", "developer", "user", "assistant", "tool"]))},
    optional={"content": _or_junk(text | st.none() | st.lists(_PART, max_size=3)), "name": junk})


# valid requests (short generations), then the same with one field replaced by anything
clean = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=24)
_VALID = {"temperature": st.sampled_from([0.0, 1e-300, 5e-324, 0.7, 2.0]) | st.floats(0.0, 2.0),
          "top_p": st.floats(0.05, 1.0), "seed": st.integers(0, 2**64), "stop": clean | st.lists(clean, max_size=4),
          "stream": st.booleans(), "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()})}


def _with_one_broken(valid):
    fields = sorted(set(_SAMPLING) | {"prompt", "messages", "max_tokens"})
    return st.tuples(valid, st.sampled_from(fields), junk).map(lambda t: {**t[0], t[1]: t[2]})


def _valid_completion():
    prompt = clean | st.lists(st.integers(0, 49151), min_size=1, max_size=12)
    return st.fixed_dictionaries({"prompt": prompt, "max_tokens": st.integers(1, 8)}, optional=_VALID)


def _valid_chat():
    message = st.fixed_dictionaries({"role": st.sampled_from(["system", "developer", "user", "assistant"]),
                                     "content": clean | st.lists(st.fixed_dictionaries(
                                         {"type": st.just("text"), "text": clean}), min_size=1, max_size=2)})
    return st.fixed_dictionaries({"messages": st.lists(message, min_size=1, max_size=3),
                                  "max_tokens": st.integers(1, 8)}, optional=_VALID)


def completion_bodies():
    prompt = _or_junk(text | st.lists(st.integers(-2, 50000), max_size=12) | st.lists(text, max_size=2))
    anything = st.fixed_dictionaries({}, optional={"prompt": prompt, **_SAMPLING})
    return st.one_of(_valid_completion(), _with_one_broken(_valid_completion()), anything)


def chat_bodies():
    anything = st.fixed_dictionaries({}, optional={"messages": _or_junk(st.lists(_MESSAGE, max_size=3)),
                                                   "max_completion_tokens": _or_junk(st.integers(-1, 24)),
                                                   **_SAMPLING})
    return st.one_of(_valid_chat(), _with_one_broken(_valid_chat()), anything)


raw_bodies = st.one_of(st.binary(max_size=64), st.just(b'{"prompt": "\xff\xfe"}'), st.just(b"[1, 2"),
                       st.just(b'{"prompt": "hi", "max_tokens": 1e999}'))


# --- what must come back --------------------------------------------------------------
TIMEOUT_S = 30     # the server's --timeout: a long valid generation ends in its 504, not a stall


def _timed_out(status: int, text: str) -> bool:
    """The server's own answer to a request past --timeout (504, error type "timeout")."""
    return status == 504 and '"type":"timeout"' in text.replace(" ", "")


def check(r: httpx.Response) -> str | None:
    """None when the answer is well-formed; else what is wrong with it."""
    if r.status_code >= 500 and not _timed_out(r.status_code, r.text):
        return f"status {r.status_code}: {r.text[:200]}"
    ctype = r.headers.get("content-type", "")
    if r.status_code >= 400:
        try:
            err = r.json()["error"]
        except (ValueError, KeyError, TypeError):
            return f"status {r.status_code} without an OpenAI error body: {r.text[:200]}"
        return None if set(err) == {"message", "type", "param", "code"} and err["message"] else f"bad error {err}"
    if ctype.startswith("text/event-stream"):
        events = [e for e in r.text.split("\n\n") if e]
        return None if events and events[-1] == "data: [DONE]" else f"stream without [DONE]: {r.text[-200:]}"
    try:
        body = r.json()
    except ValueError:
        return f"status {r.status_code} with a body that is not JSON: {r.text[:200]}"
    return None if "choices" in body or "data" in body or "openapi" in body else f"unexpected body {body}"


def send(client: httpx.Client, path: str, body) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()   # NaN, Infinity allowed
    return client.post(path, content=content, headers={"content-type": "application/json"})


def hypothesis_pass(client: httpx.Client, cases: int, seed: int, tally: Counter, findings: list) -> None:
    for kind, strategy in (("completion", completion_bodies()), ("chat", chat_bodies()), ("raw", raw_bodies)):
        path = PATHS.get(kind, PATHS["completion"])

        @settings(max_examples=cases, deadline=None, database=None, suppress_health_check=list(HealthCheck),
                  phases=(Phase.generate,))
        @fixed_seed(seed)
        @given(body=strategy)
        def one(body):
            r = send(client, path, body)
            tally[(kind, r.status_code)] += 1
            problem = check(r)
            if problem:
                findings.append({"kind": kind, "body": repr(body)[:300], "problem": problem})
        one()


def schemathesis_pass(url: str, cases: int, tally: Counter, findings: list) -> str:
    try:
        import schemathesis
        from schemathesis import GenerationMode
    except ImportError:
        return "schemathesis not installed (pip install 'specrt[fuzz]'): skipped"
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    ran = 0
    for result in schema.get_all_operations():
        op = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @settings(max_examples=cases, deadline=None, database=None, suppress_health_check=list(HealthCheck),
                      phases=(Phase.generate,))
            @given(case=op.as_strategy(generation_mode=mode))
            def one(case):
                nonlocal ran
                ran += 1
                try:
                    r = case.call(base_url=url, timeout=TIMEOUT_S + 60)
                except Exception as e:  # noqa: BLE001 - a dropped connection is a finding, not a crash
                    findings.append({"kind": "schemathesis", "body": repr(case.body)[:300], "problem": repr(e)[:200]})
                    return
                tally[(f"schemathesis {op.label} {mode.value}", r.status_code)] += 1
                if r.status_code >= 500 and not _timed_out(r.status_code, r.text):
                    findings.append({"kind": "schemathesis", "body": repr(case.body)[:300],
                                     "problem": f"status {r.status_code}: {r.text[:200]}"})
            try:
                one()
            except Unsatisfiable:     # e.g. no invalid request exists for a GET without parameters
                pass
    return f"schemathesis {getattr(schemathesis, '__version__', '')}: {ran} cases"


def server_command(engines: Path, max_num_seqs: int | None = None) -> list[str]:
    """`specrt serve` on 127.0.0.1 (its default host), a free port, a short queue and --timeout."""
    batched = [] if max_num_seqs is None else ["--max-num-seqs", str(max_num_seqs)]
    return [sys.executable, "-m", "specrt.cli", "serve", str(engines), "--host", "127.0.0.1", "--port", "0",
            "--queue-size", "2", "--timeout", str(TIMEOUT_S), *batched]


def fuzz(engines: Path, cases: int, seed: int = 0, max_num_seqs: int | None = None) -> dict:
    """Start the server, send the bodies, stop it; the report (findings empty and server_exit 0: clean)."""
    proc = subprocess.Popen(server_command(engines, max_num_seqs),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        line = proc.stdout.readline()
        found = re.search(r"on (http://\S+)/v1", line)
        if found is None:
            proc.kill()
            raise SystemExit(f"the server did not start: {line}{proc.stderr.read()[-2000:]}")
        url = found.group(1)
        tally, findings = Counter(), []
        with httpx.Client(base_url=url, timeout=TIMEOUT_S + 60) as client:
            health = client.get("/health").json()
            t0 = time.perf_counter()
            hypothesis_pass(client, cases, seed, tally, findings)
            note = schemathesis_pass(url, max(cases // 4, 10), tally, findings)
            rss1 = client.get("/health").json()["rss_mib"]
        seconds = time.perf_counter() - t0
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(120)
    finally:
        proc.kill()
        proc.wait()
    by_status = Counter()
    for (_, status), n in tally.items():
        by_status[status] += n
    server = {"method": health["method"], "rows": [w["max_num_seqs"] for w in health["workers"]]}
    return {"server": server, "cases": sum(tally.values()), "statuses": dict(sorted(by_status.items())),
            "by_kind": {f"{k} {s}": n for (k, s), n in sorted(tally.items(), key=str)},
            "rss_mib_before": health["rss_mib"], "rss_mib_after": rss1, "seconds": round(seconds, 1),
            "server_exit": code, "schemathesis": note, "findings": findings}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engines", type=Path)
    ap.add_argument("--cases", type=int, default=300, help="hypothesis examples per endpoint (default 300)")
    ap.add_argument("--seed", type=int, default=0, help="hypothesis's seed (the same seed sends the same bodies)")
    ap.add_argument("--max-num-seqs", type=int, metavar="N",
                    help="fuzz the batched server (`specrt serve --max-num-seqs N`, engines built with --batch)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    report = fuzz(a.engines, a.cases, a.seed, a.max_num_seqs)
    print(json.dumps({k: v for k, v in report.items() if k != "by_kind"}, indent=2))
    if a.json:
        a.json.write_text(json.dumps(report, indent=2))
    return 1 if report["findings"] or report["server_exit"] != 0 else 0


if __name__ == "__main__":
    sys.exit(main())
