"""Where OpenVINO's CPU time goes in one decode step (runs in .venv-openvino):

    .venv-openvino/bin/python benchmarks/peers/openvino_profile.py [.cache/peers/openvino-int4] [--batch 1,8]

The exported model (stateful: the KV cache lives in the request's state) is compiled with
PERF_COUNT on and the plugin's defaults (as the pipelines get them), given a batch of B copies
of a 96-token prompt, then stepped one token at a time; the per-node counters of the decode steps
are summed by node type and by the kernel that ran (exec_type, e.g. brgemm_avx512_amx), next to
the settings in effect (inference precision, KV cache precision, dynamic quantization). This is
the stateful model, not the paged-attention one the continuous-batching pipeline builds from it:
the matmuls are the same, the attention kernel is not.
"""
from __future__ import annotations

import argparse
import collections
import time
from pathlib import Path

import numpy as np
import openvino as ov

from openvino_peer import PROPERTIES


def profile(model_dir: Path, batch: int, threads: int, prompt: int = 96, steps: int = 16) -> dict:
    core = ov.Core()
    cm = core.compile_model(str(model_dir / "openvino_model.xml"), "CPU",
                            {"PERF_COUNT": True, "INFERENCE_NUM_THREADS": threads})
    props = {}
    for name in PROPERTIES:
        try:
            props[name] = str(cm.get_property(name))
        except Exception as e:                      # a property this version does not have
            props[name] = f"n/a ({type(e).__name__})"
    req = cm.create_infer_request()
    req.reset_state()
    ids = np.tile(np.arange(100, 100 + prompt, dtype=np.int64), (batch, 1))           # [B, T]
    inputs = {"input_ids": ids, "attention_mask": np.ones_like(ids),
              "position_ids": np.tile(np.arange(prompt, dtype=np.int64), (batch, 1)),
              "beam_idx": np.arange(batch, dtype=np.int32)}
    req.infer(inputs)
    by_type, by_kernel = collections.Counter(), collections.Counter()
    wall = []
    for i in range(steps):
        L = prompt + i + 1
        nxt = req.get_tensor("logits").data[:, -1].argmax(-1)[:, None].astype(np.int64)   # [B, 1]
        t0 = time.perf_counter()
        req.infer({"input_ids": nxt, "attention_mask": np.ones((batch, L), np.int64),
                   "position_ids": np.full((batch, 1), L - 1, np.int64), "beam_idx": np.arange(batch, dtype=np.int32)})
        wall.append(time.perf_counter() - t0)
        for p in req.get_profiling_info():
            us = p.real_time.total_seconds() * 1e6
            by_type[p.node_type] += us
            by_kernel[f"{p.node_type} / {p.exec_type}"] += us
    total = sum(by_type.values())
    return {"batch": batch, "decode_step_ms_median": 1000 * float(np.median(wall)), "properties": props,
            "by_node_type_pct": {k: round(100 * v / total, 1) for k, v in by_type.most_common(12)},
            "by_kernel_pct": {k: round(100 * v / total, 1) for k, v in by_kernel.most_common(12)}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=str(Path(__file__).resolve().parents[2] / ".cache/peers/openvino-int4"))
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    for b in (int(x) for x in a.batch.split(",")):
        r = profile(Path(a.model), b, a.threads)
        if b == int(a.batch.split(",")[0]):
            print("settings in effect: " + ", ".join(f"{k} {v}" for k, v in r["properties"].items()))
        print(f"\nbatch {b}: decode step {r['decode_step_ms_median']:.1f} ms (median of 16, wall)")
        print("  by node type: " + ", ".join(f"{k} {v}%" for k, v in r["by_node_type_pct"].items()))
        print("  by kernel:    " + ", ".join(f"{k} {v}%" for k, v in r["by_kernel_pct"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
