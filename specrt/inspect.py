"""`specrt inspect`: a manifest, readable."""
from __future__ import annotations

from specrt import manifest as mf


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def describe(man: mf.Manifest) -> str:
    s = man.shapes
    lines = [
        f"specrt manifest (schema {man.schema_version}, built by specrt {man.specrt_version})",
        f"device     {man.device.get('backend')} on {man.device.get('kind')} ({man.device.get('machine')}, {man.device.get('os')})",
        f"shapes     batch={s.batch} max_context={s.max_context} prefill_chunk={s.prefill_chunk} k={s.k} "
        f"kv_capacity={s.kv_capacity}",
        "tools      " + ", ".join(f"{k} {v}" for k, v in man.tools.items()),
        f"tokenizer  {man.tokenizer['file']} (vocab {man.tokenizer.get('vocab_size')}, eos {man.tokenizer.get('eos_token_ids')}, "
        f"chat template {'yes' if man.tokenizer.get('chat_template') else 'no'})",
    ]
    for role, m in man.models.items():
        d = m.dims
        lines += [
            "",
            f"[{role}] {m.family} {m.precision}: {d['layers']} layers, hidden {d['hidden']}, heads {d['heads']}/"
            f"{d['kv_heads']} kv, head_dim {d['head_dim']}, vocab {d['vocab']}",
            f"  source   {m.source.get('source')}" + (f" ({m.source['derived']})" if m.source.get("derived") else ""),
            f"  weights  {m.weights['file']} {_mb(m.weights['bytes'])}, {len(m.weights['initializers'])} tensors",
            f"  kv       {m.kv.get('dtype')} {m.kv.get('layout')}, {m.kv.get('update', 'returned')}"
            + (f", shares the {m.shares_cache_with}'s cache" if m.shares_cache_with else ""),
        ]
        for g, e in m.graphs.items():
            lines.append(f"  graph    {g:<8} T={e.tokens:<4} {e.file}")
        par = m.parity or {}
        for g, r in (par.get("graphs") or {}).items():
            lines.append(f"  parity   {g:<16} max|dlogit| {r['max_abs_logit_delta']:.2e}  argmax agreement "
                         f"{r['argmax_agreement']:.3f}")
        if "tolerance" in par:
            lines.append(f"  parity   tolerance {par['tolerance']:.2e} vs {par.get('reference')}")
        ag = par.get("agreement_with_target")
        if ag:
            gate = f", build requires >= {ag['min_top1_agreement']:.2f}" if "min_top1_agreement" in ag else ""
            lines.append(f"  draft    top-1 agreement with target {ag['top1_agreement']:.3f} over {ag['positions']} "
                         f"positions ({ag['regime']}{gate})")
    return "\n".join(lines)
