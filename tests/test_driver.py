"""specrt/driver.py, the torch-free driver every build check runs: its greedy helper is the
runtime's plain decoding, step by step; its prompt encoder is the runtime's; it imports no torch."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from specrt import driver
from specrt import manifest as mf
from specrt.runtime import SpeculativeGenerator
from specrt.runtime.tokenizer import Tokenizer

LONG = [(7 * i + 5) % 120 for i in range(40)]       # 40 tokens: three prefill chunks of 16


def _target(engines: Path) -> driver.GraphSet:
    man = mf.load(engines)
    graphs = {g: {"file": Path(e.file).name, "tokens": e.tokens} for g, e in man.target.graphs.items()}
    return driver.GraphSet(engines / "target", graphs, man.target.dims, man.shapes.kv_capacity)


def test_greedy_is_the_runtimes_plain_decoding(tiny_engines):
    gen = SpeculativeGenerator(tiny_engines, methods=("plain",))
    gs = _target(tiny_engines)
    for prompt in (LONG, [5, 6, 7], LONG[:16]):
        plain = [e.token for e in gen.tokens(prompt, max_new_tokens=12, method="plain")]
        assert driver.greedy(gs, prompt, 12).tokens == plain


def test_a_session_graph_set_refuses_a_provider_onnx_runtime_did_not_load(tiny_engines):
    """scripts/gpu_check.py compares graphs on CUDA through SessionGraphSet; ONNX Runtime
    falls back to the CPU when CUDA fails to load, and a comparison run there would pass
    while checking nothing. On this CPU-only machine CUDA never loads."""
    import onnxruntime as ort
    assert "CUDAExecutionProvider" not in ort.get_available_providers()
    man = mf.load(tiny_engines)
    part = {"graphs": {g: {"file": Path(e.file).name, "tokens": e.tokens} for g, e in man.target.graphs.items()},
            "dims": man.target.dims}
    with pytest.raises(RuntimeError, match="CUDAExecutionProvider was asked for"):
        driver.graph_set(tiny_engines / "target", part, man.shapes.kv_capacity,
                         providers=("CUDAExecutionProvider", "CPUExecutionProvider"))
    cpu = driver.SessionGraphSet(tiny_engines / "target", part, man.shapes.kv_capacity, 2, ("CPUExecutionProvider",))
    assert driver.greedy(cpu, LONG, 6).tokens == driver.greedy(_target(tiny_engines), LONG, 6).tokens


def test_greedy_steps_pauses_before_each_step_and_runs_only_the_steps_that_choose_a_token(tiny_engines):
    gs = _target(tiny_engines)
    out = driver.Greedy(keep_rows=True, keep_prompt_rows=True)
    steps = []
    for graph, ids, start in driver.greedy_steps(gs, LONG, 5, out):
        steps.append((graph, len(ids), start, len(out.tokens)))
    # three prefill chunks, then 4 decode steps for 5 tokens; each paused before it ran
    assert steps == [("prefill", 16, 0, 0), ("prefill", 16, 16, 0), ("prefill", 8, 32, 0),
                     ("decode", 1, 40, 1), ("decode", 1, 41, 2), ("decode", 1, 42, 3), ("decode", 1, 43, 4)]
    assert len(out.tokens) == 5 and out.prompt_rows.shape == (40, int(gs.model.entry.dims["vocab"]))
    assert np.array_equal(out.rows[0], out.prompt_rows[-1])                    # the last prompt row chose token 0
    assert [int(r.argmax()) for r in out.rows] == out.tokens


def test_greedy_stops_after_an_eos_and_keeps_it(tiny_engines):
    gs = _target(tiny_engines)
    free = driver.greedy(gs, LONG, 10).tokens
    eos = free[3]
    stop = free.index(eos)                                   # its first occurrence
    assert driver.greedy(gs, LONG, 10, eos={eos}).tokens == free[:stop + 1]


def test_encode_prompts_is_how_the_runtime_encodes_a_prompt(tiny_engines):
    gen = SpeculativeGenerator(tiny_engines, methods=("plain",))
    texts = ["Hello there", "Write a haiku about autumn leaves.", ""]
    assert gen.tokenizer.chat_template
    assert driver.encode_prompts(gen.tokenizer, texts) == [gen.encode_prompt(t, chat=True) for t in texts]
    plain = Tokenizer(tiny_engines, {**gen.manifest.tokenizer, "chat_template": None})
    assert driver.encode_prompts(plain, texts) == [gen.encode_prompt(t, chat=False) for t in texts]


def test_kl_rows_is_zero_for_equal_rows_and_positive_otherwise():
    p = np.array([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]], np.float32)
    q = np.array([[1.0, 2.0, 3.0], [5.0, 0.0, 0.0]], np.float32)
    kl = driver.kl_rows(p, q)
    assert kl[0] == pytest.approx(0.0, abs=1e-6) and kl[1] > 0.1


def test_the_driver_runs_without_torch_or_transformers(tiny_engines):
    code = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        from test_driver import _target, LONG
        from specrt import driver
        print(len(driver.greedy(_target(Path({str(tiny_engines)!r})), LONG, 3).tokens))
        print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["3", "[]"]
