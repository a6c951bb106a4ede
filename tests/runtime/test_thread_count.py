"""A folder's numbers do not depend on ONNX Runtime's thread count (`--threads`), so the kernels'
fingerprint its gates are recorded against (device.gated_on: onnxruntime's version and the
CPU's instruction sets) leaves the count out: the CPU kernels (MLAS) split a call's rows and
columns between threads, never a sum. Measured on SmolLM2 (int8row, int4, fp32 folders; 1, 2, 4
and 8 threads on the 2-core AVX2 EPYC, 2026-12-07: every prompt chunk, step and window bit for
bit); checked here on the tiny int4 and fp32 batched folders, each thread count in a process of
its own (ONNX Runtime's global thread pool is sized once a process)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

SCRIPT = textwrap.dedent('''
    import sys, numpy as np
    from pathlib import Path
    from specrt import manifest as mf
    from specrt.runtime.backends.ort_batch import OrtBatchModel
    root, threads, out = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    m = mf.load(root)
    graphs = tuple(g for g in ("step", "prefill") if g in m.batch.graphs)
    model = OrtBatchModel(root, m.batch, m.shapes, rows=4, threads=threads, graphs=graphs)
    rng = np.random.default_rng(0)
    res, C, P = {}, m.shapes.prefill_chunk, max(model.min_rows, 1)
    for r in range(4):                       # a prompt of two chunks in each row, one row a call
        for s in (0, C):
            toks = rng.integers(3, 120, (1, C)).astype(np.int64)
            pos = (np.arange(P) + C - P)[None, :].astype(np.int64)
            res[f"prefill{r}.{s}"] = model.step("prefill", toks, np.array([s], np.int64), r, pos, pad_start=0)[0].copy()
    starts = np.full(4, 2 * C, np.int64)
    for n in (1, 2, 4):                      # decode steps of 1, 2 and 4 rows
        T = max(1, -(-model.min_rows // n))
        toks = np.repeat(rng.integers(3, 120, (n, 1)).astype(np.int64), T, axis=1)
        res[f"step{n}"] = model.step("step", toks, starts[:n], 0, pad_start=2 * C).copy()
    if model.multi_token_rows is None:       # windows of several tokens a row (a speculating batch)
        res["window"] = model.step("step", rng.integers(3, 120, (4, 4)).astype(np.int64), starts, 0).copy()
    np.savez(out, **res)
''')


def _run(folder, threads: int, out) -> dict:
    subprocess.run([sys.executable, "-c", SCRIPT, str(folder), str(threads), str(out)], check=True, timeout=300)
    with np.load(out) as z:
        return {k: z[k] for k in z.files}


@pytest.mark.parametrize("fixture", ["tiny_batch_int4_engines", "tiny_batch_rows_engines"])
def test_the_same_bits_with_any_thread_count(fixture, request, tmp_path):
    folder = request.getfixturevalue(fixture)
    runs = {t: _run(folder, t, tmp_path / f"{t}.npz") for t in (1, 2, 3)}
    assert len(runs[2]) >= 10
    for t in (1, 3):
        differ = [k for k in runs[2] if not np.array_equal(runs[t][k], runs[2][k])]
        assert not differ, f"{fixture}: {t} threads give other numbers than 2 in {differ}: the thread count belongs " \
                           "in the kernels' fingerprint (runtime/backends/ort_cpu.py kernel_fingerprint)"
