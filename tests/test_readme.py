"""The README is tested: its first lines give the two commands, CI runs the same test
command, and its Python example runs as written."""
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


def test_the_python_example_runs(real_engines):
    code = re.search(r"```python\n(.*?)```", README, re.S).group(1)
    code = code.replace('"artifacts/smollm2"', repr(str(real_engines)))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "acceptance" in r.stdout and len(r.stdout.splitlines()[0]) > 5
