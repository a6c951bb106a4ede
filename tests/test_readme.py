"""The README is tested: its first lines give the two commands, CI runs the same test
command, it stays short (the rest lives in docs/), and its Python examples run as written:
the runtime one on the default engines, the openai one against a live server."""
from __future__ import annotations

import re
import subprocess
import sys

from conftest import ROOT

README = (ROOT / "README.md").read_text()


def test_readme_opens_with_the_demo_and_test_commands():
    head = README.splitlines()[:6]
    assert any(line.startswith("make demo") for line in head)
    assert any(line.startswith("make test") for line in head)


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test$", ci, re.M)


def test_makefile_installs_torch_first_and_pinned():
    mk = (ROOT / "Makefile").read_text()
    torch_line = mk.index("pip install -q torch==2.13.0")
    assert torch_line < mk.index("pip install -q -e")


def test_the_readme_stays_short():
    assert len(README.splitlines()) <= 200, "move the details to docs/ (the README is the first hour)"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README, re.S)


def test_the_python_example_runs(real_engines):
    code = python_blocks()[0]
    code = code.replace('"artifacts/smollm2"', repr(str(real_engines)))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "acceptance" in r.stdout and len(r.stdout.splitlines()[0]) > 5


def test_the_openai_example_runs_against_the_server(tiny_self_engines):
    from serve.serve_helpers import LiveServer, wait_for
    code = next(c for c in python_blocks() if "from openai import" in c)
    server = LiveServer(tiny_self_engines, workers=1, queue_size=2)
    try:
        code = code.replace("http://127.0.0.1:8000/v1", server.url + "/v1").replace('"smollm2"', repr(server.model))
        code = code.replace("max_tokens=64", "max_tokens=8")     # the tiny engines' context is 96 tokens
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert r.returncode == 0, r.stderr[-2000:]
        wait_for(lambda: server.count("/v1/chat/completions", "ok") == 1, "the server to count the request")
    finally:
        server.close()
