"""A bounded loopback load test for `specrt serve`: it stops by itself.

    .venv/bin/python benchmarks/loadtest.py artifacts/smollm2 --requests 200 --concurrency 8 --workers 2
    .venv/bin/python benchmarks/loadtest.py --url http://127.0.0.1:8000     # a server already running
    SPECRT_API_KEY=k .venv/bin/python benchmarks/loadtest.py artifacts/smollm2 --api-key   # with a key

Without --url it starts `specrt serve ENGINES --port 0` itself, runs the load, and stops
the server with SIGTERM (reporting its exit code). Every request streams (TTFT and ITL are
measured at the client, as a user sees them); prompts are `specrt bench`'s, token budgets
mixed, a share of clients disconnect after a few tokens. Reports completed / errors /
disconnected, p50 and p99 time to first token and inter-token latency, tokens/s, and the
server's RSS before and after. `--overhead N` then times N interleaved rounds of one
non-streaming server request against the bare runtime on the same prompt and tokens.

Loopback only: the URL must be 127.0.0.1 / localhost. Needs httpx (the `test` extra).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import httpx
import numpy as np

from specrt.prompts import PROMPTS


@dataclass
class Result:
    status: int = 0
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    disconnected: bool = False
    error: str = ""


def plan(n: int, lengths: list[int], disconnect: float, chat_share: float, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        out.append({"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": int(rng.choice(lengths)),
                    "chat": bool(rng.random() < chat_share),
                    "leave_after": int(rng.integers(1, 6)) if rng.random() < disconnect else None})
    return out


async def one(client: httpx.AsyncClient, url: str, model: str, spec: dict, timeout: float) -> Result:
    r = Result()
    if spec["chat"]:
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": spec["prompt"]}]}
    else:
        path, body = "/v1/completions", {"prompt": spec["prompt"]}
    body |= {"model": model, "max_tokens": spec["max_tokens"], "temperature": 0, "stream": True,
             "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    last, chunks = None, 0
    try:
        async with client.stream("POST", url + path, json=body, timeout=timeout) as resp:
            r.status = resp.status_code
            if resp.status_code != 200:
                r.error = (await resp.aread()).decode()[:200]
                return r
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    r.error = ev["error"]["message"][:200]
                    return r
                if ev.get("usage"):
                    r.tokens = ev["usage"]["completion_tokens"]
                    continue
                c = ev["choices"][0]
                if c.get("text") or (c.get("delta") or {}).get("content"):
                    now = time.perf_counter()
                    if last is None:
                        r.ttft = now - t0
                    else:
                        r.gaps.append(now - last)
                    last, chunks = now, chunks + 1
                    if spec["leave_after"] is not None and chunks >= spec["leave_after"]:
                        r.disconnected, r.tokens = True, chunks
                        return r            # leaving the block closes the connection mid-stream
    except (httpx.HTTPError, OSError) as e:
        r.error = f"{type(e).__name__}: {e}"
    return r


async def run_load(url: str, model: str, specs: list[dict], concurrency: int, timeout: float,
                   deadline: float, headers: dict) -> tuple[list[Result], float]:
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(limits=limits, headers=headers) as client:
        async def guarded(spec):
            async with sem:
                return await one(client, url, model, spec, timeout)
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(guarded(s)) for s in specs]
        done, pending = await asyncio.wait(tasks, timeout=deadline)
        for t in pending:                   # bounded: whatever is left past the deadline is abandoned
            t.cancel()
        wall = time.perf_counter() - t0
    return [t.result() for t in done if not t.cancelled()], wall


def pct(xs: list[float], q: float) -> str:
    return f"{np.percentile(xs, q) * 1000:.1f} ms" if xs else "n/a"


def proc_rss(pid: int | None) -> str:
    """RSS and peak of the server process, and how much of the RSS is anonymous (its own) vs
    file-backed (`--memory shared` maps weights.bin: clean pages shared with the page cache,
    counted once per mapping in RSS)."""
    if pid is None:
        return ""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        rss, hwm, anon, file = (int(re.search(rf"{k}:\s+(\d+)", status).group(1)) / 1024
                                for k in ("VmRSS", "VmHWM", "RssAnon", "RssFile"))
        return f" (VmRSS {rss:.0f} MiB = anon {anon:.0f} + file-backed {file:.0f}; peak {hwm:.0f} MiB)"
    except (OSError, AttributeError):
        return ""


def report(results: list[Result], wall: float, n_planned: int) -> dict:
    ok = [r for r in results if r.status == 200 and not r.error]
    completed = [r for r in ok if not r.disconnected]
    errors: dict[str, int] = {}
    for r in results:
        if r.status != 200 or r.error:
            key = f"HTTP {r.status}" if r.status != 200 else r.error[:60]
            errors[key] = errors.get(key, 0) + 1
    ttft = [r.ttft for r in ok if r.ttft is not None]
    gaps = [g for r in ok for g in r.gaps]
    # time per output token: a request's own average gap (speculation releases tokens in bursts,
    # so single gaps are mostly ~0 within a burst and one verify step between bursts)
    tpot = [sum(r.gaps) / len(r.gaps) for r in ok if r.gaps]
    tokens = sum(r.tokens for r in ok)
    return {"planned": n_planned, "finished": len(results), "completed": len(completed),
            "disconnected_early": sum(r.disconnected for r in ok), "errors": errors,
            "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99), "itl_p50": pct(gaps, 50), "itl_p99": pct(gaps, 99),
            "tpot_p50": pct(tpot, 50), "tpot_p99": pct(tpot, 99),
            "tokens": tokens, "wall_s": round(wall, 1), "tokens_per_s": round(tokens / wall, 1) if wall else 0.0,
            "requests_per_s": round(len(results) / wall, 2) if wall else 0.0}


def overhead(url: str, model: str, engines: str, rounds: int, max_tokens: int, headers: dict) -> dict:
    """Same chat prompt, same tokens: one non-streaming server request vs the bare runtime, interleaved."""
    from specrt.runtime import SpeculativeGenerator
    gen = SpeculativeGenerator(engines, methods=("speculative",))
    prompt = PROMPTS[0]
    server_s, bare_s, worker_s = [], [], []
    with httpx.Client(timeout=300, headers=headers) as c:
        for i in range(rounds + 1):         # round 0 warms both up and is not counted
            t0 = time.perf_counter()
            got = c.post(url + "/v1/chat/completions", json={
                "model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                "temperature": 0}).json()
            t1 = time.perf_counter()
            want = gen.generate(prompt, chat=True, max_new_tokens=max_tokens)
            t2 = time.perf_counter()
            assert got["choices"][0]["message"]["content"] == want.text, "server and runtime disagree"
            if i:
                server_s.append(t1 - t0)
                bare_s.append(t2 - t1)
                worker_s.append(got["specrt"]["time_s"])
    med = lambda xs: float(np.median(xs)) * 1000  # noqa: E731
    return {"rounds": rounds, "tokens": got["usage"]["completion_tokens"], "server_ms": round(med(server_s), 1),
            "bare_runtime_ms": round(med(bare_s), 1), "server_minus_bare_ms": round(med(server_s) - med(bare_s), 1),
            "server_minus_its_own_generation_ms": round(med([s - w for s, w in zip(server_s, worker_s)]), 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engines", nargs="?", help="engine folder (starts a server); with --url: for --overhead only")
    ap.add_argument("--url", help="a running server on 127.0.0.1 (default: start one)")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--queue-size", type=int, default=16)
    ap.add_argument("--memory", choices=("fast", "shared"), default="fast")
    ap.add_argument("--lengths", default="16,32,64,128", help="max_tokens values, mixed at random")
    ap.add_argument("--disconnect", type=float, default=0.1, help="share of clients that leave after 1-5 tokens")
    ap.add_argument("--chat-share", type=float, default=0.5)
    ap.add_argument("--timeout", type=float, default=300.0, help="per request (client side)")
    ap.add_argument("--deadline", type=float, default=1200.0, help="the whole load stops after this many seconds")
    ap.add_argument("--overhead", type=int, default=0, metavar="N", help="then N rounds of server vs bare runtime")
    ap.add_argument("--overhead-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--api-key", action="store_true",
                    help="with a key: the server started here requires SPECRT_API_KEY (a random one if unset), every "
                         "request sends it, and a request without it must get 401")
    ap.add_argument("--json", metavar="FILE")
    a = ap.parse_args()
    key = (os.environ.get("SPECRT_API_KEY") or secrets.token_urlsafe(24)) if a.api_key else None
    headers = {"authorization": f"Bearer {key}"} if key else {}

    proc, pid = None, None
    if a.url:
        url = a.url.rstrip("/")
        if urlparse(url).hostname not in ("127.0.0.1", "localhost"):
            print("loadtest: loopback only: give a http://127.0.0.1:PORT URL", file=sys.stderr)
            return 2
    else:
        if not a.engines:
            ap.error("give ENGINES (to start a server) or --url")
        cmd = [sys.executable, "-m", "specrt.cli", "serve", a.engines, "--port", "0", "--workers", str(a.workers),
               "--queue-size", str(a.queue_size), "--memory", a.memory, "--timeout", str(a.timeout)]
        env = dict(os.environ, **({"SPECRT_API_KEY": key} if key else {}))   # never on the command line
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
        line = proc.stdout.readline()
        m = re.search(r"on (http://\S+)/v1", line)
        if not m:
            print(f"loadtest: the server did not start: {line.strip()}", file=sys.stderr)
            proc.kill()
            return 1
        url, pid = m.group(1), proc.pid
        print(line.strip())
    try:
        if key:
            denied = httpx.get(url + "/v1/models", timeout=30).status_code
            print(f"API key: required (a request without it got HTTP {denied})")
            if denied != 401:
                raise SystemExit("loadtest: the server answered a request without the key")
        health = httpx.get(url + "/health", timeout=30).json()
        model = health["model"]
        print(f"server before: RSS {health['rss_mib']:.0f} MiB{proc_rss(pid)}, workers "
              + ", ".join(f"#{w['index']} +{w['load_mib']:.0f} MiB ({w['memory']})" for w in health["workers"]))
        specs = plan(a.requests, [int(x) for x in a.lengths.split(",")], a.disconnect, a.chat_share, a.seed)
        print(f"load: {a.requests} streamed requests, concurrency {a.concurrency}, max_tokens in {{{a.lengths}}}, "
              f"{sum(s['leave_after'] is not None for s in specs)} leave early, deadline {a.deadline:g} s")
        results, wall = asyncio.run(run_load(url, model, specs, a.concurrency, a.timeout, a.deadline, headers))
        rep = report(results, wall, a.requests)
        after = httpx.get(url + "/health", timeout=30).json()
        rep["rss_before_mib"], rep["rss_after_mib"] = health["rss_mib"], after["rss_mib"]
        metrics = httpx.get(url + "/metrics", timeout=30, headers=headers).text
        acc = re.search(r"^specrt_spec_decode_acceptance_rate\{[^}]*\} (\S+)", metrics, re.M)
        rep["server_acceptance_rate"] = round(float(acc.group(1)), 4) if acc else None
        rep["server_outcomes"] = {f"{e}:{o}": int(float(v)) for e, o, v in re.findall(
            r'^specrt_requests_total\{endpoint="([^"]+)",model="[^"]*",outcome="([^"]+)"\} (\S+)', metrics, re.M)}
        print(f"completed {rep['completed']}/{rep['planned']} | disconnected early {rep['disconnected_early']} | "
              f"errors {sum(rep['errors'].values())} {rep['errors'] or ''}")
        print(f"TTFT p50 {rep['ttft_p50']} p99 {rep['ttft_p99']} | ITL p50 {rep['itl_p50']} p99 {rep['itl_p99']} | "
              f"time per output token p50 {rep['tpot_p50']} p99 {rep['tpot_p99']}")
        print(f"{rep['tokens']} tokens in {rep['wall_s']} s: {rep['tokens_per_s']} tok/s, "
              f"{rep['requests_per_s']} req/s | server acceptance rate {rep['server_acceptance_rate']}")
        print(f"server RSS before {rep['rss_before_mib']:.0f} MiB, after {rep['rss_after_mib']:.0f} MiB{proc_rss(pid)}")
        print(f"server outcomes: {rep['server_outcomes']}")
        if a.overhead:
            if not a.engines:
                ap.error("--overhead needs ENGINES (the bare runtime loads them)")
            rep["overhead"] = o = overhead(url, model, a.engines, a.overhead, a.overhead_tokens, headers)
            print(f"overhead ({o['rounds']} rounds, {o['tokens']} tokens, greedy, same prompt): server "
                  f"{o['server_ms']} ms vs bare runtime {o['bare_runtime_ms']} ms -> +{o['server_minus_bare_ms']} ms; "
                  f"server minus its own generation time {o['server_minus_its_own_generation_ms']} ms")
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                rc = proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
            print(f"server stopped by SIGTERM: exit code {rc}")
    if a.json:
        Path(a.json).write_text(json.dumps(rep, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
