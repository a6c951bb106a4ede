"""Servers over HTTP for `benchmarks/concurrency.py`: start one (specrt serve, llama-server) on a
free loopback port, and drive it with N streaming clients.

Every request is a streamed `/v1/completions` call with the prompt as token ids, greedy
(temperature 0), `max_tokens` = the budget; the server stops at an EOS. A record per request:

    {"index": i, "t_submit": s, "t_chunks": [s, ...], "n_tokens": n, "text": "...", "finish_reason": "stop"}

times in seconds from the start of the run; one t_chunks entry per streamed chunk that carried
text (a chunk may hold several tokens: speculation releases them in bursts); n_tokens is the
server's `usage.completion_tokens` (`stream_options.include_usage`), else the chunk count.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server started by command line, ready once `health` answers 200; stopped by SIGTERM."""

    def __init__(self, cmd: list[str], port: int, log: Path, health: str = "/health", env: dict | None = None,
                 ready_timeout: float = 600.0):
        self.url = f"http://127.0.0.1:{port}"
        self.cmd = cmd
        self._log = open(log, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})
        deadline = time.monotonic() + ready_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{' '.join(cmd)} exited with code {self.proc.returncode}: see {log}")
            try:
                if httpx.get(self.url + health, timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"{' '.join(cmd)} not ready after {ready_timeout:.0f} s: see {log}")
            time.sleep(0.25)

    def rss_mib(self) -> float | None:
        try:
            status = Path(f"/proc/{self.proc.pid}/status").read_text()
            return int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024
        except (OSError, AttributeError):
            return None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


async def _one(client: httpx.AsyncClient, url: str, body: dict, index: int, t0: float, timeout: float) -> dict:
    rec = {"index": index, "t_submit": time.perf_counter() - t0, "t_chunks": [], "n_tokens": None, "text": "",
           "finish_reason": None}
    parts = []
    async with client.stream("POST", url + "/v1/completions", json=body, timeout=timeout) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status_code}: {(await resp.aread()).decode()[:300]}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                raise RuntimeError(f"{url}: {ev['error']}")
            if ev.get("usage"):
                rec["n_tokens"] = ev["usage"]["completion_tokens"]
            for c in ev.get("choices") or ():
                rec["finish_reason"] = c.get("finish_reason") or rec["finish_reason"]
                if c.get("text"):
                    rec["t_chunks"].append(time.perf_counter() - t0)
                    parts.append(c["text"])
    rec["text"] = "".join(parts)
    if rec["n_tokens"] is None:
        rec["n_tokens"] = len(rec["t_chunks"])
    return rec


async def _drive(url: str, bodies: list[dict], clients: int, timeout: float) -> list[dict]:
    """`clients` concurrent clients, each sending its next request when its previous one ends."""
    queue = list(enumerate(bodies))
    out: list[dict] = []
    t0 = time.perf_counter()
    # a connection per request: llama-server (cpp-httplib) closes a kept-alive connection after a
    # few requests, and a client reusing it then sees "Server disconnected"
    limits = httpx.Limits(max_connections=clients + 2, max_keepalive_connections=0)
    async with httpx.AsyncClient(limits=limits) as client:
        async def client_loop():
            while queue:
                i, body = queue.pop(0)
                out.append(await _one(client, url, body, i, t0, timeout))
        await asyncio.gather(*(client_loop() for _ in range(clients)))
    return sorted(out, key=lambda r: r["index"])


def stream_completions(url: str, model: str | None, prompts: list[list[int]], max_tokens: int, clients: int,
                       extra: dict | None = None, timeout: float = 600.0) -> list[dict]:
    """Send every prompt (token ids) through `clients` concurrent streaming clients."""
    bodies = [{**({"model": model} if model else {}), "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
               "stream": True, "stream_options": {"include_usage": True}, **(extra or {})} for ids in prompts]
    return asyncio.run(_drive(url, bodies, clients, timeout))
