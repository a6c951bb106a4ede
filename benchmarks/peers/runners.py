"""The systems of `benchmarks/concurrency.py`, each behind one lifecycle:

    runner.prepare(clients)   start or reconfigure for `clients` clients, warm up (not measured)
    runner.run(prompts, clients, n, eos) -> (records, extra)
    runner.close()

records: one per prompt, in order: {"index", "t_submit", "t_chunks", "n_tokens", "answer"}, times
in seconds from the start of run(); t_chunks = when each streamed chunk (HTTP) or token
(in-process) arrived; answer = the text (HTTP) or the token ids (in-process), compared only with
the same system's own answer to the same prompt served alone. extra: what else the system
reports (RSS of a server, step costs by batch size of an in-process peer).
"""
from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path

import httpx

from common import ROOT, Worker
from streams import ServerProcess, free_port, stream_completions

WARM_TOKENS = 4


def _from_worker(recs: list[dict]) -> list[dict]:
    return [{"index": r["index"], "t_submit": r["t_submit"], "t_chunks": r["t_tokens"], "n_tokens": len(r["tokens"]),
             "answer": r["tokens"]} for r in recs]


def _step_costs(steps: list) -> dict:
    """Mean seconds per forward pass, by the number of rows (requests) it served."""
    by: dict[int, list[float]] = {}
    for rows, s in steps:
        by.setdefault(int(rows), []).append(s)
    return {str(k): {"steps": len(v), "mean_ms": 1000 * sum(v) / len(v)} for k, v in sorted(by.items())}


class _Server:
    """An OpenAI-compatible server process, restarted when its command line for `clients` changes."""

    extra_body: dict = {}
    env: dict = {}

    def __init__(self, log_dir: Path):
        self.server, self.cmd_key, self.log_dir = None, None, log_dir

    def command(self, clients: int, port: int) -> list[str]:
        raise NotImplementedError

    def prepare(self, clients: int) -> None:
        key = self.command(clients, 0)
        if self.server is None or key != self.cmd_key:
            self.close()
            port = free_port()
            self.server = ServerProcess(self.command(clients, port), port, self.log_dir / f"{self.name}.log",
                                        health=self.health, env=self.env)
            self.cmd_key = key
        warm = [[*range(100, 116)]] * clients
        stream_completions(self.server.url, self.model, warm, WARM_TOKENS, clients, self.extra_body)

    @property
    def model(self) -> str | None:
        return None

    def run(self, prompts, clients, n, eos):
        # no EOS ids (concurrency.py --ignore-eos): every request runs its n tokens (vLLM's ignore_eos,
        # which specrt's server and llama-server take too)
        body = {**self.extra_body, **({} if eos else {"ignore_eos": True})}
        recs = stream_completions(self.server.url, self.model, prompts, n, clients, body)
        for r in recs:
            r["answer"] = r.pop("text")
        return recs, {"rss_mib": self.server.rss_mib()}

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None


class SpecrtServer(_Server):
    """`specrt serve ENGINES --port P --threads T ARGS`; ARGS may hold `{clients}` (e.g.
    `--max-num-seqs {clients}`): then the server is restarted for each concurrency level."""

    health = "/health"
    # this checkout's specrt, whatever the venv installed; PYTHONSAFEPATH: `python -m` would put the
    # working directory (the repository root, where the benchmarks run) before PYTHONPATH, and an
    # -alt server given another checkout ran this one's code (found 2026-12-07: its tok/s and RSS
    # equal to the last digit)
    env = {"PYTHONPATH": str(ROOT), "PYTHONSAFEPATH": "1"}

    def __init__(self, name: str, engines: Path, serve_args: str, threads: int, log_dir: Path,
                 checkout: str | Path | None = None):
        super().__init__(log_dir)
        self.name, self.engines, self.serve_args, self.threads = name, engines, serve_args, threads
        if checkout is not None:        # another checkout's specrt (an A/B of two versions)
            self.env = {"PYTHONPATH": str(Path(checkout).resolve()), "PYTHONSAFEPATH": "1"}

    def command(self, clients, port):
        return [sys.executable, "-m", "specrt.cli", "serve", str(self.engines), "--port", str(port),
                "--threads", str(self.threads), *shlex.split(self.serve_args.format(clients=clients))]

    def run(self, prompts, clients, n, eos):
        recs, extra = super().run(prompts, clients, n, eos)
        for r in recs:          # its usage leaves out the EOS it generated; the in-process systems count it
            r["n_tokens"] += r["finish_reason"] == "stop"
        extra["health"] = httpx.get(self.server.url + "/health", timeout=30).json()
        return recs, extra


class LlamaServer(_Server):
    """llama.cpp's `llama-server -np N` (parallel slots over one model, continuous batching on),
    each slot `slot_context` tokens; prompt caching off (the same request comes twice)."""

    health = "/health"
    extra_body = {"cache_prompt": False}

    def __init__(self, name: str, binary: Path, gguf: Path, threads: int, log_dir: Path, slot_context: int = 1024):
        super().__init__(log_dir)
        self.name, self.binary, self.gguf, self.threads, self.slot_context = name, binary, gguf, threads, slot_context

    def command(self, clients, port):
        return [str(self.binary), "-m", str(self.gguf), "--host", "127.0.0.1", "--port", str(port),
                "-np", str(clients), "-c", str(clients * self.slot_context), "--cont-batching",
                "-t", str(self.threads), "-tb", str(self.threads), "--no-cache-prompt", "--cache-ram", "0",
                "--no-webui"]


class GenaiBatches:
    """onnxruntime-genai's batch API in its own worker (.venv-peers): static batches of `clients`."""

    def __init__(self, name: str, path: Path, python: Path, threads: int):
        self.name = name
        self.worker = Worker("genai", path, python, threads)

    def prepare(self, clients):
        self.worker.ask(op="batch", requests=[[*range(100, 116)]] * clients, batch=clients, n=WARM_TOKENS, eos=[])

    def run(self, prompts, clients, n, eos):
        r = self.worker.ask(op="batch", requests=prompts, batch=clients, n=n, eos=eos)
        return _from_worker(r["records"]), {"step_costs": _step_costs(r["steps"])}

    def close(self):
        self.worker.close()


class OpenVINOBatching(GenaiBatches):
    """OpenVINO GenAI's continuous batching in its own worker (.venv-openvino): at most `clients`
    requests in flight, `SchedulerConfig.max_num_seqs` = clients (openvino_peer.py)."""

    def __init__(self, name: str, path: Path, python: Path, threads: int):
        self.name = name
        self.worker = Worker("openvino", path, python, threads)

    def prepare(self, clients):
        self.worker.ask(op="serve", requests=[[*range(100, 116)]] * clients, clients=clients, n=WARM_TOKENS, eos=[])

    def run(self, prompts, clients, n, eos):
        r = self.worker.ask(op="serve", requests=prompts, clients=clients, n=n, eos=eos)
        return _from_worker(r["records"]), {"step_costs": _step_costs(r["steps"])}


class SpecrtStream(GenaiBatches):
    """Today's single-stream runtime in-process (speculative, the default method), one request at a
    time: the 1-client reference the server must not fall behind."""

    def __init__(self, name: str, engines: Path, threads: int):
        self.name = name
        self.worker = Worker("specrt", engines, Path(sys.executable), threads, (("PYTHONPATH", str(ROOT)),))

    def prepare(self, clients):
        self.worker.ask(op="generate", ids=[*range(100, 116)], n=WARM_TOKENS, eos=[], method="speculative")

    def run(self, prompts, clients, n, eos):
        recs, t0 = [], time.perf_counter()
        for i, ids in enumerate(prompts):
            t_submit = time.perf_counter() - t0
            r = self.worker.ask(op="generate", ids=ids, n=n, eos=eos, method="speculative")
            recs.append({"index": i, "t_submit": t_submit, "t_chunks": [t_submit + t for t in r["t_tokens"]],
                         "n_tokens": len(r["tokens"]), "answer": r["tokens"]})
        return recs, {}


class SpecrtBatched(GenaiBatches):
    """specrt's batched engine in its own worker process (`open_batch`, no server): what genai and
    OpenVINO are measured as, so the HTTP server and the client's CPU are not in the comparison."""

    def __init__(self, name: str, engines: Path, threads: int):
        self.name = name
        self.worker = Worker("specrt-batch", engines, Path(sys.executable), threads, (("PYTHONPATH", str(ROOT)),))

    def prepare(self, clients):
        self.worker.ask(op="serve", requests=[[*range(100, 116)]] * clients, clients=clients, n=WARM_TOKENS, eos=[])

    def run(self, prompts, clients, n, eos):
        r = self.worker.ask(op="serve", requests=prompts, clients=clients, n=n, eos=eos)
        recs = _from_worker(r["records"])
        for rec in recs:            # its EOS was recorded as -1: the answer is the tokens before it
            if rec["answer"] and rec["answer"][-1] == -1:
                rec["answer"] = rec["answer"][:-1]
        return recs, {}
