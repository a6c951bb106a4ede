"""The examples/ scripts run as a user runs them, against tiny engines: generate.py streams the
runtime's own greedy answer, openai_client.py streams the server's (which is the runtime's),
and own_model.sh builds a target + draft pair, inspects it and generates."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import ROOT
from serve.serve_helpers import LiveServer

from specrt.runtime import SpeculativeGenerator

EXAMPLES = ROOT / "examples"
PROMPT = "Name three colors."
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}   # this checkout's specrt, not an installed one


def run(*cmd, timeout=300, **env) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**ENV, **env})


@pytest.fixture(scope="module")
def reference(tiny_self_engines):
    """What every example must print: the runtime's greedy chat answer on the same engines."""
    return SpeculativeGenerator(tiny_self_engines).generate(
        [{"role": "user", "content": PROMPT}], max_new_tokens=12).text


def test_generate_streams_the_runtimes_answer_and_its_metrics(tiny_self_engines, reference):
    r = run(sys.executable, EXAMPLES / "generate.py", tiny_self_engines, "--prompt", PROMPT, "--max-new-tokens", 12)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout == reference + "\n"
    assert "acceptance" in r.stderr and "finish: " in r.stderr


def test_generate_names_the_problem_for_a_folder_without_engines(tmp_path):
    r = run(sys.executable, EXAMPLES / "generate.py", tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("error: ") and "Traceback" not in r.stderr


def test_the_openai_client_streams_the_servers_answer(tiny_self_engines, reference):
    server = LiveServer(tiny_self_engines, workers=1, queue_size=2)
    try:
        r = run(sys.executable, EXAMPLES / "openai_client.py", "--base-url", server.url + "/v1",
                "--prompt", PROMPT, "--max-tokens", 12, timeout=120)
    finally:
        server.close()
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout == reference + "\n"
    assert f"{server.model}: " in r.stderr and "completion tokens" in r.stderr


def test_the_openai_client_reports_a_refusal(tiny_self_engines):
    server = LiveServer(tiny_self_engines, workers=1, queue_size=2)
    try:
        r = run(sys.executable, EXAMPLES / "openai_client.py", "--base-url", server.url + "/v1",
                "--model", "no-such-model", timeout=120)
    finally:
        server.close()
    assert r.returncode == 2 and "error: " in r.stderr and "Traceback" not in r.stderr


def test_own_model_builds_a_pair_inspects_and_generates(tiny_pair, tmp_path):
    target, draft = tiny_pair
    out = tmp_path / "mine"
    r = run("bash", EXAMPLES / "own_model.sh", target, draft, out,
            "--max-context", 96, "--prefill-chunk", 16, "--k", 3, "--no-measure-costs",
            SPECRT=f"{sys.executable} -m specrt.cli", PROMPT=PROMPT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (out / "manifest.json").exists()
    want = SpeculativeGenerator(out).generate(PROMPT, chat=True, max_new_tokens=32).text
    assert want and want in r.stdout


def test_own_model_explains_itself():
    r = run("bash", EXAMPLES / "own_model.sh", "--help")
    assert r.returncode == 0 and "TARGET DRAFT OUT" in r.stdout and "set -euo" not in r.stdout
    r = run("bash", EXAMPLES / "own_model.sh")
    assert r.returncode == 2 and "TARGET DRAFT OUT" in r.stdout


def test_the_batch_example_gives_every_caller_the_generators_answer(tiny_batch_rows_draft_engines):
    """examples/batch.py on one engine (offline batch, threads, coroutines, a seeded sample, a
    cancel): every answer is SpeculativeGenerator's for the same prompt, the folder's one answer."""
    import json

    from specrt.runtime import SamplingParams
    r = run(sys.executable, EXAMPLES / "batch.py", tiny_batch_rows_draft_engines, "--json", "--max-new-tokens", 12,
            "--max-num-seqs", 3)
    assert r.returncode == 0, r.stderr[-2000:]
    got = [json.loads(line) for line in r.stdout.splitlines()]
    assert [g["how"] for g in got] == ["generate_batch"] * 4 + ["thread"] * 2 + ["coroutine"] * 2 + \
        ["coroutine, seeded", "cancelled"]
    gen = SpeculativeGenerator(tiny_batch_rows_draft_engines)
    for g in got[:-1]:
        sp = SamplingParams(temperature=0.8, seed=7) if g["how"] == "coroutine, seeded" else SamplingParams()
        assert g["text"] == gen.generate(g["prompt"], chat=True, max_new_tokens=12, sampling=sp).text, g
    full = gen.generate(got[-1]["prompt"], chat=True, max_new_tokens=12).text
    assert got[-1]["finish"] == "cancelled" and full.startswith(got[-1]["text"]) and got[-1]["text"] != full
