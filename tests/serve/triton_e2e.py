"""End to end on a live Triton Inference Server: the `tritonserver` bundled in
`nvidia-pytriton` serving the repository `specrt triton-repo` writes.

Not part of `make test` (it needs a separate environment: nvidia-pytriton, numpy<2 and
specrt's runtime, ~400 MB). Run it with that environment's interpreter:

    python -m venv /tmp/triton-venv
    /tmp/triton-venv/bin/pip install nvidia-pytriton 'numpy<2' onnxruntime onnx tokenizers jinja2
    /tmp/triton-venv/bin/pip install --no-deps -e .
    /tmp/triton-venv/bin/python tests/serve/triton_e2e.py ENGINES [--instances 2]
    /tmp/triton-venv/bin/python tests/serve/triton_e2e.py ENGINES --max-num-seqs 4   # batched (--batch engines)

It sets what the bundled server needs (REFERENCE.md section 6): the interpreter's
libpython directory and `nvidia_pytriton.libs` on LD_LIBRARY_PATH, the environment's
bin first on PATH, and a Python-backend folder holding the stub built for this Python.
Exit 0 when every check passed.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def environment(work: Path) -> tuple[Path, Path, dict]:
    """(tritonserver binary, backend dir, env) from the installed nvidia-pytriton."""
    import pytriton
    root = Path(pytriton.__file__).parent / "tritonserver"
    libs = Path(pytriton.__file__).parent.parent / "nvidia_pytriton.libs"
    backends = work / "backends"
    (backends / "python").mkdir(parents=True)
    for f in (root / "backends" / "python").iterdir():
        if f.is_file():
            shutil.copy(f, backends / "python")
    ver = f"{sys.version_info.major}.{sys.version_info.minor}"
    shutil.copy(root / "python_backend_stubs" / ver / "triton_python_backend_stub", backends / "python")
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [sysconfig.get_config_var("LIBDIR"), str(libs),
                                                           env.get("LD_LIBRARY_PATH")]))
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env["PATH"]
    return root / "bin" / "tritonserver", backends, env


def generate_stream(url: str, body: dict) -> tuple[str, str, list]:
    """POST the generate_stream extension; returns (text, finish_reason, events)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    events = []
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            for line in r:
                line = line.decode().strip()
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
    except urllib.error.HTTPError as e:    # an error before the first response: HTTP 400, same SSE body
        events += [json.loads(line[6:]) | {"status": e.code} for line in e.read().decode().splitlines()
                   if line.startswith("data: ")]
    text = "".join(e.get("text_output", "") for e in events)
    return text, (events[-1].get("finish_reason", "") if events else ""), events


def cut_stream(url: str) -> bool:
    """Read the first response of a long stream, then close the connection."""
    body = json.dumps({"text_input": "Once upon a time", "max_tokens": 200}).encode()
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return any(line.startswith(b"data: ") for line in r)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("engines")
    ap.add_argument("--instances", type=int, default=2)
    ap.add_argument("--max-num-seqs", type=int, help="serve with one batched engine (one instance)")
    a = ap.parse_args()
    from specrt.runtime import SamplingParams, SpeculativeGenerator
    from specrt.runtime.batch.generator import open_batch
    from specrt.serve.triton import write_triton_repo
    if a.max_num_seqs:
        a.instances = 1

    work = Path(tempfile.mkdtemp(prefix="specrt-triton-"))
    binary, backends, env = environment(work)
    write_triton_repo(a.engines, work / "repo", model_name="specrt", instances=a.instances,
                      max_num_seqs=a.max_num_seqs)
    http, grpc, metrics = free_port(), free_port(), free_port()
    log = open(work / "tritonserver.log", "w")
    t0 = time.perf_counter()
    proc = subprocess.Popen([str(binary), "--model-repository", str(work / "repo"), "--backend-directory",
                             str(backends), "--http-address", "127.0.0.1", "--http-port", str(http),
                             "--grpc-address", "127.0.0.1", "--grpc-port", str(grpc),
                             "--metrics-port", str(metrics)], env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{http}"
    failures = []

    def check(ok: bool, what: str):
        print(("ok   " if ok else "FAIL ") + what)
        if not ok:
            failures.append(what)

    try:
        for _ in range(600):
            try:
                if urllib.request.urlopen(base + "/v2/models/specrt/ready", timeout=2).status == 200:
                    break
            except (urllib.error.URLError, ConnectionError):
                if proc.poll() is not None:
                    break
                time.sleep(0.2)
        check(proc.poll() is None, f"tritonserver started, model READY ({time.perf_counter() - t0:.1f} s, "
                                   f"{a.instances} instances)")
        if failures:
            return 1
        print(urllib.request.urlopen(base + "/v2", timeout=10).read().decode()[:200])
        # the reference: the same engine serving one request at a time
        gen = (open_batch(a.engines, max_num_seqs=1) if a.max_num_seqs else
               SpeculativeGenerator(a.engines, methods=("speculative",)))
        name = type(gen).__name__
        url = base + "/v2/models/specrt/generate_stream"

        for prompt, n, chat in (("Once upon a time", 24, False), ("Name three colors.", 32, True)):
            text, finish, events = generate_stream(url, {"text_input": prompt, "max_tokens": n, "chat": chat})
            want = gen.generate(prompt, max_new_tokens=n, chat=chat)
            check(text == want.text, f"greedy {'chat' if chat else 'text'} stream == {name}.generate "
                                     f"({len(events)} responses, finish_reason={finish!r}): {text[:60]!r}")
        text, _, _ = generate_stream(url, {"text_input": "Hello", "max_tokens": 20, "temperature": 0.75,
                                           "top_p": 0.9, "seed": 3})
        # FP32 inputs: 0.75 and 0.9 arrive as float32 values
        sp = SamplingParams(temperature=float(np.float32(0.75)), top_p=float(np.float32(0.9)), seed=3)
        check(text == gen.generate("Hello", max_new_tokens=20, sampling=sp).text, "seeded sampling == runtime")

        prompts = ["abc", "The sky", "Once upon a time", "Hello, world", "0123", "Tell me a story."]
        want = {p: gen.generate(p, max_new_tokens=16).text for p in prompts}
        with cf.ThreadPoolExecutor(len(prompts)) as ex:
            got = dict(zip(prompts, ex.map(lambda p: generate_stream(url, {"text_input": p, "max_tokens": 16})[0],
                                           prompts)))
        check(got == want, f"{len(prompts)} concurrent streams on {a.instances} instances"
                           f"{f' (max_num_seqs {a.max_num_seqs})' if a.max_num_seqs else ''} each == its solo output")
        if a.max_num_seqs:
            check(cut_stream(url) and generate_stream(url, {"text_input": "abc", "max_tokens": 16})[0] == want["abc"],
                  "a client that leaves mid-stream: the next request is answered right")

        _, _, events = generate_stream(url, {"text_input": "Hi", "temperature": -1.0})
        check(len(events) == 1 and "SamplingParamsError" in events[0].get("error", ""),
              f"bad request -> one error event: {events[0] if events else None}")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        check(rc == 0, f"tritonserver exited {rc} after SIGTERM (log: {work / 'tritonserver.log'})")
    print("ALL PASSED" if not failures else f"{len(failures)} FAILED")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
