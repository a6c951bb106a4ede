"""The batched graphs' calls with ONNX Runtime's packed weights on 4 KiB and on 2 MiB pages
(runtime/backends/huge_pages.py), side by side in one process: each is opened twice, in the
order small, huge, small, huge (which model a process opens first can be slower on its own),
every copy fills the same prompt, and calls of each shape alternate between the copies.
Prints ms per call (median) and huge / small. Not part of `make test`.

    python benchmarks/huge_pages.py artifacts/smollm2 [--rows 1,8] [--tokens 1,5] [--calls 40]
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np

from specrt import manifest
from specrt.runtime.backends.huge_pages import ENV
from specrt.runtime.backends.ort_batch import OrtBatchModel


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("engines", type=Path)
    ap.add_argument("--rows", default="1,8")
    ap.add_argument("--tokens", default="1,5")
    ap.add_argument("--calls", type=int, default=40)
    ap.add_argument("--context", type=int, default=120, help="prompt positions filled before the calls")
    a = ap.parse_args()
    man = manifest.load(a.engines)
    T_all = [int(t) for t in a.tokens.split(",")]
    print(f"{'rows x T':>9} {'4 KiB ms':>9} {'2 MiB ms':>9}  2 MiB / 4 KiB")
    for rows in (int(r) for r in a.rows.split(",")):
        copies = {}
        for name in ("small1", "huge1", "small2", "huge2"):
            os.environ[ENV] = "1" if name.startswith("huge") else "0"
            copies[name] = OrtBatchModel(a.engines, man.models["batch"], man.shapes, rows=rows, graphs=("step",))
        os.environ.pop(ENV)
        toks = np.random.default_rng(0).integers(100, 20000, (rows, a.context + max(T_all)))
        for m in copies.values():
            for s in range(0, a.context, 40):
                m.step("prefill", toks[:, s:min(s + 40, a.context)], np.full(rows, s))
        times = {(k, T): [] for k in copies for T in T_all}
        for _ in range(a.calls):
            for T in T_all:
                for k, m in copies.items():
                    t = time.perf_counter()
                    m.step("verify", toks[:, a.context:a.context + T], np.full(rows, a.context))
                    times[k, T].append(time.perf_counter() - t)
        for T in T_all:
            med = {k: float(np.median(times[k, T][3:])) * 1e3 for k in copies}
            small, huge = (med["small1"] + med["small2"]) / 2, (med["huge1"] + med["huge2"]) / 2
            print(f"{rows:>4} x {T:<3} {small:9.2f} {huge:9.2f}  x{huge / small:.3f}")
        del copies


if __name__ == "__main__":
    main()
