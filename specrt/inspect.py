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
        q = m.source.get("quantization")
        if q:
            lines.append(f"  quant    {q.get('method')}, {q.get('bits')}-bit, block {q.get('block_size')}, "
                         f"{'symmetric' if q.get('symmetric') else 'asymmetric'}, {q.get('compute', '?')} compute"
                         + (f", LM head {'quantized' if q.get('lm_head_quantized') else 'fp32'}"
                            if "lm_head_quantized" in q else ""))
        par = m.parity or {}
        export = par.get("fp32_export", par)   # a quantized target keeps its fp32 export's parity apart
        label = "fp32 export " if "fp32_export" in par else ""
        for g, r in (export.get("graphs") or {}).items():
            lines.append(f"  parity   {label}{g:<16} max|dlogit| {r['max_abs_logit_delta']:.2e}  argmax agreement "
                         f"{r['argmax_agreement']:.3f}")
        if "tolerance" in export:
            lines.append(f"  parity   {label}tolerance {export['tolerance']:.2e} vs {export.get('reference')}")
        idn = par.get("identity")
        if idn:
            lines.append(f"  identity decode vs verify: {idn['argmax_flips']} argmax flips in {idn['rows']} rows, "
                         f"{idn['bitwise_equal_rows']} bit for bit (max|dlogit| {idn['max_abs_logit_delta']:.1e})"
                         + (f"; {idn['guarantee']}" if idn.get("guarantee") else ""))
        f32 = par.get("agreement_with_fp32")
        if f32:
            lines.append(f"  vs fp32  top-1 agreement {f32['top1_agreement']:.3f} over {f32['positions']} positions, "
                         f"mean KL {f32.get('mean_kl', float('nan')):.3f}")
        for key, what in (("agreement_with_target", "target"), ("agreement_with_fp32_target", "fp32 target")):
            ag = par.get(key)
            if ag:
                gate = f", build requires >= {ag['min_top1_agreement']:.2f}" if "min_top1_agreement" in ag else ""
                lines.append(f"  draft    top-1 agreement with {what} {ag['top1_agreement']:.3f} over "
                             f"{ag['positions']} positions ({ag['regime']}{gate})")
    return "\n".join(lines)
