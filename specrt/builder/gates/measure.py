"""How well a draft agrees with its target: top-1 agreement position by position on
real prompts, in the regime the runtime uses (a shared-cache draft reads the target's
cache for the context)."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from specrt import manifest as mf
from specrt.driver import GraphSet


def draft_agreement(target_dir: Path, target: dict, draft_dir: Path, draft: dict, shapes: mf.Shapes,
                    token_lists: list[list[int]], *, shared_cache: bool) -> dict:
    agree = total = 0
    max_delta = 0.0
    for ids in token_lists:
        ids = ids[: shapes.prefill_chunk]
        t = GraphSet(target_dir, {"prefill": target["graphs"]["prefill"]}, target["dims"], shapes.kv_capacity)
        ref = t.step("prefill", ids, 0)                                     # [n, V]
        dgraphs = {g: draft["graphs"][g] for g in ("decode",)}
        d = GraphSet(draft_dir, dgraphs, draft["dims"], shapes.kv_capacity)
        if shared_cache:
            for c, tc in zip(d.cache, t.cache):
                c[...] = tc                      # the target's K/V for the context, as at run time
            for i in range(len(ids)):
                got = d.step("decode", ids[i:i + 1], i)[0]
                for c, tc in zip(d.cache, t.cache):   # undo the draft's own row i
                    c[:, :, i] = tc[:, :, i]
                agree += int(got.argmax() == ref[i].argmax())
                max_delta = max(max_delta, float(np.abs(got - ref[i]).max()))
                total += 1
        else:
            for i in range(len(ids)):
                got = d.step("decode", ids[i:i + 1], i)[0]
                agree += int(got.argmax() == ref[i].argmax())
                max_delta = max(max_delta, float(np.abs(got - ref[i]).max()))
                total += 1
    return {"top1_agreement": agree / total if total else 0.0, "positions": total,
            "max_abs_logit_delta": max_delta, "regime": "shared target cache" if shared_cache else "own cache"}
