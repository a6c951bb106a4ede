"""scripts/gpu_check.sh fails loudly without a GPU (never silently green), and the parts of
its checks that can run on a CPU do, with a pretend GPU probe: they report the CPU
comparisons and list every GPU check they could not run, exiting non-zero."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _run(env_extra: dict) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable, **env_extra}
    return subprocess.run(["bash", str(SCRIPT), "--skip-default"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_without_a_visible_gpu_the_script_exits_2_with_a_clear_message():
    p = _run({"CUDA_VISIBLE_DEVICES": ""})
    assert p.returncode == 2, (p.returncode, p.stdout, p.stderr)
    assert "gpu_check: FAILED: no NVIDIA GPU" in p.stderr
    assert "cannot pass without a GPU" in p.stderr
    assert "PASSED" not in p.stdout + p.stderr


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="this machine has an NVIDIA driver")
def test_on_this_cpu_machine_the_script_fails_loudly():
    p = _run({})
    assert p.returncode == 2 and "nvidia-smi is not installed" in p.stderr, (p.returncode, p.stderr)


def _load_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_python_checks_refuse_a_machine_where_cuda_sees_no_gpu(monkeypatch, tmp_path):
    from specrt.builder import backend
    monkeypatch.setattr(backend, "probe", lambda: backend.Probe())
    assert _load_check().main(["--out", str(tmp_path), "--skip-default"]) == 2


def test_with_a_pretend_gpu_the_cpu_comparisons_run_and_every_gpu_check_is_listed_not_run(monkeypatch, tmp_path):
    from specrt.builder import backend
    monkeypatch.setattr(backend, "probe", lambda: backend.Probe(gpu="pretend GPU"))
    code = _load_check().main(["--out", str(tmp_path), "--skip-default"])
    rows = json.loads((tmp_path / "gpu_check.json").read_text())
    status = {name: s for name, s, _ in rows}
    assert code == 3, rows                                     # incomplete: never green
    assert status["tiny gqa: fp16 vs fp32, both on ORT CPU"] == "PASS"
    assert status["tiny standard: fp16 vs fp32, both on ORT CPU"] == "PASS"
    assert status["tiny gqa static total: fp16 vs fp32, both on ORT CPU"] == "PASS"
    assert status["tiny: ORT CUDA checks"] == status["tiny: TensorRT checks"] == "NOT RUN"
    assert status["tiny ort-cuda: build and generator"] == status["tiny tensorrt: build and generator"] == "NOT RUN"
    assert sum(s == "NOT RUN" for s in status.values()) >= 2 + 1 + 2


def test_a_greedy_flip_is_a_near_tie_only_within_the_logit_tolerance():
    check = _load_check()
    report = {"tolerance": 0.3, "graphs": {"decode": {"max_abs_logit_delta": 0.1}},
              "greedy": {"tokens": 32, "identical_prefix": 7,
                         "first_divergence": {"position": 7, "fp32_top2_margin": 0.05}}}
    assert check.greedy_status(report)[0] == "PASS" and "near-tie" in check.greedy_status(report)[1]
    report["greedy"]["first_divergence"]["fp32_top2_margin"] = 2.0
    assert check.greedy_status(report)[0] == "FAIL"


def test_the_generator_check_passes_identical_engines_and_reports_speed(tiny_pair, tmp_path):
    """check_generator on two CPU folders: what it runs on a GPU against the fp32 CPU engines."""
    from conftest import build_tiny
    check = _load_check()
    engines = build_tiny(tmp_path / "e", tiny_pair[0], "none")
    status, detail = check.check_generator(engines, engines, {}, [5, 6, 7, 8, 9, 10] * 3, n=24)
    assert status == "PASS", detail
    assert detail.count("24/24 identical to fp32 CPU") == 3 and "decode tok/s plain" in detail


def test_the_generator_check_compares_a_draft_models_speculation_with_plain(tiny_engines):
    """proposer="speculative": what the script runs on its truncated-draft GPU build."""
    check = _load_check()
    status, detail = check.check_generator(tiny_engines, tiny_engines, {}, [5, 6, 7, 8, 9, 10] * 3, n=24,
                                           proposer="speculative")
    assert status == "PASS", detail
    assert detail.count("24/24 identical to fp32 CPU") == 3 and "speculative" in detail and "draft" in detail
