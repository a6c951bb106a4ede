"""`specrt inspect`: a manifest, readable."""
from __future__ import annotations

from specrt import manifest as mf
from specrt.cpu_features import int8_kernels


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


_DEVICE_KEYS = ("backend", "kind", "machine", "os", "int8_kernels", "gated_on")


def _device(dev: dict) -> str:
    facts = "".join(f"; {k} {v}" for k, v in dev.items() if k not in _DEVICE_KEYS)
    # quantized engines load only where the int8 path matches (manifest_device.check_int8_kernels)
    if "int8_kernels" in dev:
        facts += f"; int8 kernels {dev['int8_kernels']} (this CPU: {int8_kernels()})"
    return f"{dev.get('backend')} on {dev.get('kind')} ({dev.get('machine')}, {dev.get('os')}){facts}"


def _gated(man: mf.Manifest) -> list[str]:
    """Where the folder's exactness gates were measured (manifest_device.check_gated refuses other kernels)."""
    where = mf.gated_kernels(man)
    if where is None or man.device.get("kind") != "cpu":
        return []
    from specrt.runtime.backends.ort_cpu import kernel_fingerprint
    here = kernel_fingerprint()
    by = [f"{g.get('kernels')} ({g.get('by')}, {g.get('at')})" for g in man.device["gated_on"] if isinstance(g, dict)]
    verdict = ("this machine's: it serves here" if here in where else
               f"not this machine's ({here}): refused here until `specrt retime` measures them")
    return [f"gated      exactness gates held on: {'; '.join(by)}; {verdict}"]


def _engines(e: dict) -> list[str]:
    """The top-level engine fields of a TensorRT build."""
    tc = e.get("timing_cache") or {}
    b = e.get("builder") or {}
    return [f"engines    TensorRT {e['tensorrt_version']} on {e['gpu_name']} (compute capability "
            f"{e['compute_capability']}), hardware compatibility {e['hardware_compatibility_level']}",
            "builder    " + ", ".join(f"{k} {v}" for k, v in b.items()),
            f"timing     {tc.get('file')}" + (" (reused)" if tc.get("reused") else " (new)"),
            f"build log  {len(e.get('build_log') or [])} TensorRT warning/error lines (manifest engines.build_log)"]


def _fp16(par: dict) -> list[str]:
    lines = []
    for key in ("fp16_vs_fp32", "fp16_cuda_vs_fp32_cpu"):
        r = par.get(key)
        if not r:
            continue
        for g, x in r["graphs"].items():
            lines.append(f"  {key[:4]}     {g:<8} vs fp32 max|dlogit| {x['max_abs_logit_delta']:.2e}  argmax agreement "
                         f"{x['argmax_agreement']:.3f}  on {r.get('provider')}")
        gr = r["greedy"]
        lines.append(f"  {key[:4]}     tolerance {r['tolerance']:.2e} (atol {r['atol']} + rtol {r['rtol']} x max|logit|)"
                     f"; greedy {gr['identical_prefix']}/{gr['tokens']} tokens identical to fp32")
    return lines


def _quality(q: dict) -> list[str]:
    r = q.get("row", {})
    return [f"quality    vs {q.get('reference')}: top-1 {r.get('top1_agreement', 0):.3f} over {r.get('positions')} "
            f"positions, mean KL {r.get('mean_kl', 0):.4g}, max |dlogit| {r.get('max_abs_logit_delta', 0):.3g}, "
            f"greedy = {r.get('greedy_exact_match')}/{r.get('greedy_prompts')}"
            + (f", of its {r['runs']}" if r.get("runs") else " (of its one-row graphs)") + f" ({q.get('measured_by')})"]


def _num(x) -> str:
    """A measured number for reading: 4 significant digits (0.9945652173913043 -> 0.9946)."""
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def _plan(sp: dict) -> list[str]:
    c, ch = sp.get("costs_ms", {}), sp.get("chosen", {})
    pred = ", ".join(f"{k} x{v:.2f}" for k, v in (sp.get("predicted") or {}).items())
    return [f"plan       step ms: target decode {_num(c.get('target_decode'))}, verify "
            f"{_num(c.get('target_verify'))}, draft {_num(c.get('draft_decode', '-'))}; acceptance "
            f"{_num(sp.get('acceptance'))}; predicted {pred or '-'}; chosen "
            f"{ch.get('method')} k={ch.get('k')} (adaptive k at run time starts from these)"] + _retimed(sp)


def _retimed(sp: dict) -> list[str]:
    from specrt.builder.gates.quiet import warning
    r, c = sp.get("retimed"), sp.get("conditions")
    share = (f"; other processes used x{c['others_share']:.2f} of the machine's CPU time while timing"
             if isinstance(c, dict) and isinstance(c.get("others_share"), (int, float)) else "")
    busy = [f"           {warning(c)}"] if warning(c) else []
    if not isinstance(r, dict):
        return [f"timed      by the build, where it ran (`specrt retime FOLDER` measures again where it serves){share}",
                *busy]
    return [f"timed      by {r.get('by')} at {r.get('at')} (the build's costs kept in build.speculation.retimed)"
            f"{share}", *busy]


def _proposers(props: dict) -> list[str]:
    n = props.get("ngrams")
    return [f"ngrams     {n['file']}: {n.get('entries')} n-grams (n <= {n.get('orders')}) of the target's own "
            f"{n.get('generated_tokens')} greedy tokens on {n.get('prompts')} calibration prompts: pair-round "
            "guesses"] if n else []


def _runs(man: mf.Manifest) -> str:
    """Which engine every caller runs (runtime/one.py): the batched model, or the one-row graphs."""
    from specrt.errors import ManifestError
    from specrt.runtime.one import draft_left_out, plain_because
    if man.batch is None:
        return "runs       every request on the one-row graphs (no --batch: the server runs one request per engine copy)"
    try:
        why = plain_because(man)
    except ManifestError as e:
        why = f"a damaged record ({e})"
    how = f"plain steps only: {why}" if why else "speculating per step by measured cost"
    if not why and man.batch_draft is not None:
        how += " (the draft model inside the batch, its own cache per row)"
    elif not why and "draft" in man.batch.graphs:
        how += " (the int8 self-draft inside the batch)"
    left = "; the one-row draft is not used (no batched draft graph)" if draft_left_out(man) and not why else ""
    return ("runs       every request (generate, the API, the server, Triton) on the batched model, a batch of one "
            f"or many: {how}{left}")


def kernel_faster(table: dict, margin: float = 0.9) -> list[tuple[dict, str, float]]:
    """(shape, family, its time / the running family's) where a measured family takes less than
    `margin` of the time of the family the folder runs there."""
    out = []
    for sh in table.get("shapes") or []:
        ms = sh.get("ms") or {}
        own, best = ms.get(sh.get("runs")), sh.get("fastest")
        if own and best in ms and best != sh.get("runs") and ms[best] < margin * own:
            out.append((sh, best, ms[best] / own))
    return out


def kernel_summary(table: dict) -> str | None:
    """One line for the end of a build: where another kernel family would be faster (None: nowhere)."""
    faster = kernel_faster(table)
    if not faster:
        return None
    sh, best, ratio = min(faster, key=lambda f: f[2])
    return (f"kernels: another family is faster at {len(faster)} of {len(table.get('shapes') or [])} of the shapes "
            f"this folder runs (most: {sh['use']}, {best} x{ratio:.2f}); `specrt inspect` shows the table "
            "(a family is a --precision: another model, `specrt quality` shows its faithfulness)")


def serving_hint(table: dict, max_num_seqs: int) -> str | None:
    """`specrt serve`'s note when the kernel table says another family's weight MatMuls are much
    faster (< x0.9) at the widest decode step this server runs (the table's largest "decode, N
    requests" with 1 < N <= max_num_seqs); None otherwise, and for one row (the single stream)."""
    steps = [sh for sh in table.get("shapes") or [] if sh.get("tokens") == 1 and sh.get("model", "batch") == "batch"
             and str(sh.get("use", "")).startswith("decode, ") and isinstance(sh.get("rows"), int)
             and 1 < sh["rows"] <= max_num_seqs]
    if not steps:
        return None
    widest = max(steps, key=lambda sh: sh["rows"])
    hit = [(best, ratio) for sh, best, ratio in kernel_faster(table) if sh is widest]
    if not hit:
        return None
    best, ratio = hit[0]
    ms = widest["ms"]
    return (f"at {widest['rows']} requests a step's weight MatMuls take {ms[widest['runs']]:.1f} ms in this folder's "
            f"{widest['runs']} and {ms[best]:.1f} ms in {best} (x{ratio:.2f}, measured by {table.get('measured_by')}): "
            f"to serve many requests at once, a build with --precision {best} may be faster (another model: "
            "`specrt quality` shows its faithfulness; docs/batching.md)")


def kernel_lines(table: dict) -> list[str]:
    """`specrt inspect`'s rendering: one row per runtime shape, * on the family it runs."""
    if "error" in table:
        return [f"kernels    not measured: {table['error']} (`specrt retime` measures it again)"]
    fams = list(table.get("families") or ())
    out = [f"kernels    weight MatMuls, ms a call (median of {table.get('runs')} interleaved rounds, "
           f"{table.get('threads')} threads, int8 kernels {table.get('int8_kernels')}), measured by "
           f"{table.get('measured_by')} at {table.get('at')}; * = the family the folder runs",
           f"  {'shape':<42} {'rows x T':>9}  " + "".join(f"{f:>9}" for f in fams) + "  graph"]
    for sh in table.get("shapes") or []:
        ms = sh.get("ms") or {}
        cells = "".join(f"{('*' if f == sh.get('runs') else '') + format(ms[f], '.2f'):>9}" if f in ms else f"{'-':>9}"
                        for f in fams)
        out.append(f"  {sh['use']:<42} {str(sh['rows']) + ' x ' + str(sh['tokens']):>9}  {cells}  {sh['graph']}")
    faster = [f"{sh['use']} {best} x{ratio:.2f}" for sh, best, ratio in kernel_faster(table)]
    if faster:
        out.append("  faster here than what runs (another family changes the numbers: a rebuild with its "
                   "--precision, faithfulness in `specrt quality`): " + "; ".join(faster))
    return out


def _fp32_figure_of(role: str, man: mf.Manifest) -> str:
    """What a model's build-time "vs fp32" figure describes, where a folder has two models."""
    if man.batch is None:
        return ""
    if role == "batch":
        return " (the batched model, as every request runs it)"
    if role == "target":
        own = (man.batch.parity or {}).get("agreement_with_fp32")
        return (" (these one-row graphs: the folder's requests run its batched model, "
                + ("measured below)" if own else "which `specrt quality` measures)"))
    return ""


def describe(man: mf.Manifest) -> str:
    s = man.shapes
    choice = man.build.get("backend") or {}
    lines = [
        f"specrt manifest (schema {man.schema_version}, built by specrt {man.specrt_version})",
        f"device     {_device(man.device)}",
        *_gated(man),
        *([f"backend    {choice.get('backend')} ({choice.get('reason')})"] if choice else []),
        *(_engines(man.engines) if man.engines else []),
        _runs(man),
        *(_quality(man.quality) if man.quality else []),
        *(_plan(man.build.get("speculation")) if man.build.get("speculation") else []),
        *(_proposers(man.proposers) if man.proposers else []),
        *(kernel_lines(man.build["kernels"]) if isinstance(man.build.get("kernels"), dict) else []),
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
            # a batched graph's T (and rows) are symbolic: one graph serves every window
            T = "any" if e.dynamic_tokens else e.tokens
            lines.append(f"  graph    {g:<8} T={T:<4} {e.file}"
                         + (f"  engine {e.engine['file']} {_mb(e.engine['bytes'])}" if e.engine else "")
                         + ("  (rows: any)" if e.batch == "dynamic" else ""))
        if role == "batch" and m.source.get("attention"):
            lines.append(f"  attention {m.source['attention']}"
                         + (" (several tokens a row in a batch: speculates)" if m.source["attention"] == "rows" else ""))
        pg = m.source.get("prefill_graph")
        if pg:      # `--batch-prefill rowwise`: the prompt-chunk graph's own quantization (and attention)
            att = pg.get("attention")
            pi = (m.parity or {}).get("prompt_invariance") if isinstance(m.parity, dict) else None
            gate = (f"; the same bits in any cache row and length (max |delta| {pi.get('max_abs_logit_delta', '?')})"
                    if isinstance(pi, dict) and pi.get("equal") is True else "")
            lines.append(f"  prefill  {pg.get('method')}, {pg.get('activations')}"
                         + (f", attention {att}" if isinstance(att, str) and att != m.source.get("attention") else "")
                         + f": {pg.get('runs')}{gate}")
        ci = (m.parity or {}).get("chunk_invariance") if isinstance(m.parity, dict) else None
        if role == "batch" and isinstance(ci, dict) and isinstance(ci.get("chunks"), list) and len(ci["chunks"]) == 2:
            small, big = ci["chunks"]
            lines.append(f"  chunks   a request alone: prompt chunks of {big} tokens (the same bits as {small})"
                         if ci.get("equal") is True else
                         f"  chunks   prompt chunks of {small} tokens always ({big} tokens give other numbers: "
                         f"max |delta logit| {ci.get('max_abs_logit_delta', '?')})" if ci.get("equal") is False else
                         f"  chunks   prompt chunks of {small} tokens always ({ci.get('why', 'not checked')})")
        pr = (m.parity or {}).get("prompt_rows") if isinstance(m.parity, dict) else None
        if role == "batch" and isinstance(pr, dict):
            lines.append("  prompts  requests admitted together share prompt calls (the same bits as each alone)"
                         if pr.get("equal") is True else
                         f"  prompts  one request a prompt call (several give other numbers: max |delta logit| "
                         f"{pr.get('max_abs_logit_delta', '?')})" if pr.get("equal") is False else
                         f"  prompts  one request a prompt call ({pr.get('why', 'not checked')})")
        dg = m.source.get("draft_graph")
        if isinstance(dg, dict):      # the int8 self-draft inside a batch
            agree = (m.parity or {}).get("draft_agreement") if isinstance(m.parity, dict) else None
            agree = agree if isinstance(agree, dict) else {}
            att = dg.get("attention")
            att = f", attention {att}" + (" (one token a row)" if att == "gqa" else "") if isinstance(att, str) else ""
            lines.append(f"  draft    {dg.get('method')}, {dg.get('bits')}-bit{att}: {dg.get('runs')}; top-1 agreement "
                         f"with this model {agree.get('top1_agreement', '?')}")
        if role == "batch_draft":      # a draft model inside a batch, its own cache per row
            agree = (m.parity or {}).get("draft_agreement") if isinstance(m.parity, dict) else None
            agree = agree if isinstance(agree, dict) else {}
            lines.append(f"  draft    runs inside the batch with its own cache per row; top-1 agreement with the batched "
                         f"target {agree.get('top1_agreement', '?')}")
        q = m.source.get("quantization")
        if q:
            how = (f"{q.get('weight_range')} per channel, activations {q.get('activations')}"
                   if "weight_range" in q else
                   f"{q.get('bits')}-bit, block {q.get('block_size')}, "
                   f"{'symmetric' if q.get('symmetric') else 'asymmetric'}, {q.get('compute', '?')} compute")
            lines.append(f"  quant    {q.get('method')}, {how}"
                         + (f", LM head {'quantized' if q.get('lm_head_quantized') else 'fp32'}"
                            if "lm_head_quantized" in q else "")
                         + (", calls padded to an even number of rows" if int(m.io.get("row_multiple", 1)) > 1 else ""))
        par = m.parity or {}
        export = par.get("fp32_export", par)   # a quantized target keeps its fp32 export's parity apart
        label = "fp32 export " if "fp32_export" in par else ""
        for g, r in (export.get("graphs") or {}).items():
            lines.append(f"  parity   {label}{g:<16} max|dlogit| {r['max_abs_logit_delta']:.2e}  argmax agreement "
                         f"{r['argmax_agreement']:.3f}")
        if "tolerance" in export:
            lines.append(f"  parity   {label}tolerance {export['tolerance']:.2e} vs {export.get('reference')}")
        lines += _fp16(par)
        idn = par.get("identity")
        if idn:
            lines.append(f"  identity decode vs verify: {idn['argmax_flips']} argmax flips in {idn['rows']} rows, "
                         f"{idn['bitwise_equal_rows']} bit for bit (max|dlogit| {idn['max_abs_logit_delta']:.1e})"
                         + (f"; {idn['guarantee']}" if idn.get("guarantee") else ""))
        f32 = par.get("agreement_with_fp32")
        if f32:
            lines.append(f"  vs fp32  top-1 agreement {f32['top1_agreement']:.3f} over {f32['positions']} positions, "
                         f"mean KL {f32.get('mean_kl', float('nan')):.3f}"
                         + _fp32_figure_of(role, man))
        for key, what in (("agreement_with_target", "target"), ("agreement_with_fp32_target", "fp32 target")):
            ag = par.get(key)
            if ag:
                gate = f", build requires >= {ag['min_top1_agreement']:.2f}" if "min_top1_agreement" in ag else ""
                lines.append(f"  draft    top-1 agreement with {what} {ag['top1_agreement']:.3f} over "
                             f"{ag['positions']} positions ({ag['regime']}{gate})")
    return "\n".join(lines)
