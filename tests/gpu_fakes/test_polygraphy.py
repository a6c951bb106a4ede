"""Polygraphy on the standard-op graphs, with its ONNX Runtime (CPU) runner: the CPU half of
the GPU comparison. On a GPU the same reference outputs are compared with a TensorRT
engine (`polygraphy run verify.plan --model-type engine --trt --load-outputs ref.json`,
README "GPU path"); that half has not run here (no GPU, no TensorRT)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import make_tiny_model_dir

from specrt.export import onnx_export, sources
from specrt.manifest import Shapes

SHAPES = Shapes(batch=1, max_context=64, prefill_chunk=16, k=3)


def _polygraphy() -> str:
    exe = Path(sys.executable).parent / "polygraphy"
    if not exe.exists():
        pytest.fail("polygraphy is not installed: pip install -e '.[test]' (or '.[gpu-tools]')")
    return str(exe)


@pytest.fixture(scope="module")
def verify_graph(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("poly")
    lm = sources.load_source(make_tiny_model_dir(tmp / "model", "llama", layers=2))
    onnx_export.export_model(lm, SHAPES, tmp / "onnx", graphs=("verify",), attention="standard")
    return tmp / "onnx" / "verify.onnx"


def _run(*args, cwd: Path) -> str:
    p = subprocess.run([_polygraphy(), *args], cwd=cwd, capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    return out


def test_polygraphy_inspects_the_standard_graph(verify_graph):
    out = _run("inspect", "model", verify_graph.name, cwd=verify_graph.parent)
    assert "ONNX Opset: 24" in out
    assert "past_k_0 [dtype=float32, shape=(1, 2, 80, 16)]" in out
    assert "present_k_0 [dtype=float32, shape=(1, 2, 80, 16)]" in out
    assert "logits [dtype=float32, shape=(1, 4, 128)]" in out


def test_polygraphy_runs_it_on_onnxruntime_and_compares_saved_outputs(verify_graph, tmp_path):
    """Save the ORT outputs (the reference a GPU run loads), then compare a second run
    against them, as the TensorRT comparison does with --trt."""
    ref = tmp_path / "ref.json"
    bounds = ["--val-range", "input_ids:[0,100]", "past_len:[0,40]", "--seed", "42"]
    out = _run("run", verify_graph.name, "--onnxrt", *bounds, "--save-outputs", str(ref), cwd=verify_graph.parent)
    assert "PASSED" in out
    saved = json.loads(ref.read_text())
    assert saved, "no outputs saved"
    out = _run("run", verify_graph.name, "--onnxrt", *bounds, "--load-outputs", str(ref),
               "--atol", "1e-5", "--rtol", "1e-5", cwd=verify_graph.parent)
    assert "All outputs matched | Outputs: ['logits', 'present_k_0'" in out
    assert "Pass Rate: 100.00%" in out
