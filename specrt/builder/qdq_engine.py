"""`specrt qdq`: an engine folder whose target is the calibrated INT8 Q/DQ copy of an fp32
folder's target (calibration/qdq.py), runnable like any `specrt build` output.

    ENGINES/ (fp32, checked: manifest, files, hashes)          DIR/ (through outdir.py)
      target/{prefill,decode,verify}.onnx ──calibrate, quantize──> target/*.onnx + weights.bin
                                           rules check, parity vs fp32, decode/verify identity
      tokenizer.json ──────────────── copy ─────────────────────> tokenizer.json
      draft/* ──────── copy; its agreement with ────────────────> draft/*
                       the Q/DQ target measured again
                                                                   manifest.json (manifest_writer.py)

The Q/DQ target keeps the fp32 target's dims, KV dtype, layout and update mode (attention
and the cache stay float), so a draft that reads the target's cache still can: checked,
not assumed. The folder is written into a hidden sibling and swapped into place only
when everything passed (outdir.py), so a failed run leaves DIR as it was.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import onnx

from specrt import manifest as mf
from specrt.calibration import qdq_parity
from specrt.calibration.qdq import QDQRuleError, QDQSpec, check_rules, collect_ranges, prompt_sets, \
    quantize_graph, tokenize
from specrt.errors import BuildOutputError, ConfigError, ParityError

PRECISION = "int8-qdq"
# what the cache-sharing draft reads of the target's cache: these must not change
_CACHE_DIMS = ("layers", "kv_heads", "head_dim")
_CACHE_KV = ("dtype", "layout", "update")


def make_qdq(engines: str | Path, out: str | Path, spec: QDQSpec = QDQSpec(), *, force: bool = False,
             progress=print) -> mf.Manifest:
    """Calibrate, quantize, check and measure the target of the fp32 folder `engines`;
    write the engine folder `out` (replacing a previous specrt folder there; another
    folder only with force=True). Returns its manifest."""
    from specrt.builder import manifest_writer, outdir
    from specrt.builder.steps import GATE_PROMPTS
    from specrt.calibration.quantize import quiet_logging
    from specrt.driver import GraphSet
    from specrt.export import weights as wpack
    from specrt.runtime.backends.ort_cpu import pool_threads

    t0 = time.time()
    engines = Path(engines)
    man = _checked_source(engines)
    path = outdir.preflight(out, force=force)
    _refuse_overlap(engines, path, out)
    target, shapes = man.target, man.shapes
    # GraphSet reads weights.bin beside the graphs: address the target's own folder
    src = engines / Path(target.weights["file"]).parent
    graphs = {g: {"file": str(Path(e.file).relative_to(src.relative_to(engines))), "tokens": e.tokens,
                  "sha256": e.sha256} for g, e in target.graphs.items()}
    dims, vocab = target.dims, int(target.dims["vocab"])
    threads = spec.threads or pool_threads() or 2
    cal_texts, eval_texts, source = prompt_sets(spec.prompts, spec.eval_prompts)
    limit = shapes.max_context - spec.decode_steps - shapes.k - 1
    cal_ids, eval_ids = tokenize(engines, man, cal_texts, limit), tokenize(engines, man, eval_texts, limit)
    from specrt.prompts import PROMPTS
    id_ids = tokenize(engines, man, list(PROMPTS[:GATE_PROMPTS]), shapes.prefill_chunk)
    tmp = outdir.make_partial(path)
    try:
        work = Path(tempfile.mkdtemp(prefix="specrt-qdq-"))
        try:
            progress(f"calibrating on {len(cal_ids)} prompts (prefill, decode, verify regimes)")
            ranges, counts = collect_ranges(src, graphs, dims, shapes, cal_ids, spec, work, threads)
            protos = {}
            for g in ("prefill", "verify"):
                progress(f"quantizing {g}")
                protos[g] = quantize_graph(src / graphs[g]["file"], work / f"{g}.onnx", ranges, vocab, spec, work)
            protos["decode"] = decode_graph(protos["verify"], shapes.k + 1)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        rules = check_rules(protos)
        if not rules["passed"]:
            raise QDQRuleError("the Q/DQ graphs break TensorRT's INT8 rules: " + "; ".join(rules["problems"][:5])
                               + " (nothing was written; report this with the ONNX Runtime version)")
        qdir = tmp / "target"
        qdir.mkdir()
        entries, winfo = wpack.save_graphs(protos, qdir, {g: graphs[g]["tokens"] for g in protos})
        del protos
        progress(f"parity on {len(eval_ids)} held-out prompts")
        with quiet_logging():
            ref_gs = GraphSet(src, graphs, dims, shapes.kv_capacity, threads=threads)
            q_gs = GraphSet(qdir, entries, dims, shapes.kv_capacity, threads=threads)
        par = qdq_parity.parity(ref_gs, q_gs, eval_ids, shapes, spec.decode_steps)
        qdq_parity.check_finite(par)
        timing = qdq_parity.step_times(ref_gs, q_gs, shapes, threads)
        del ref_gs, q_gs
        part = {"subdir": "target", "graphs": entries, "weights": winfo, "dims": dims, "family": target.family,
                "precision": PRECISION, "kv": dict(target.kv)}
        progress(f"decode/verify identity on {len(id_ids)} prompts")
        identity = check_identity(qdir, part, shapes, id_ids)
        part["parity"] = {"fp32_export": target.parity, "identity": identity,
                          "agreement_with_fp32": {**par["all"], **{k: v for k, v in par.items() if k != "all"},
                                                  "held_out_source": source}}
        part["source"] = {
            **target.source, "derived": "int8 static Q/DQ (TensorRT form: symmetric, per-channel weights, "
                                        "per-tensor activations) of the fp32 target",
            "engines": str(engines.resolve()), "manifest_sha256": mf.sha256_file(engines / mf.FILENAME),
            "target_graphs": {g: e["sha256"] for g, e in graphs.items()},
            "attention_ops": _attention_ops(src / graphs["decode"]["file"]),
            "quantization": _how(spec, shapes, rules, ranges, counts, len(cal_ids), source)}
        parts = {"target": part}
        tok = copy_tokenizer(man, engines, tmp)
        if man.draft is not None:
            progress("draft: copied from the source, agreement with the Q/DQ target measured")
            parts["draft"] = copy_draft(man, engines, tmp, part, id_ids)
        build = {"command": "specrt qdq", "config": {**asdict(spec), "source_engines": str(engines)},
                 "timing": timing}
        if (man.build or {}).get("speculation") and "draft" in parts:   # adaptive k starts from these costs
            from specrt.builder.gates import plan
            d = parts["draft"]
            costs = plan.step_costs(qdir, part, tmp / d["subdir"], d, shapes)
            build["speculation"] = plan.plan(costs, d["parity"]["agreement_with_target"]["top1_agreement"], shapes.k)
        build["seconds"] = round(time.time() - t0, 1)
        result = manifest_writer.write_manifest(tmp, shapes, parts, tok, build, device=manifest_writer.cpu_device())
        outdir.commit(tmp, path)
    finally:
        outdir.discard(tmp)        # a failed run leaves nothing behind; `out` is untouched
    return result


def summary(man: mf.Manifest, out: str | Path) -> str:
    """What `specrt qdq` prints about the folder it wrote: the rules check, each graph's
    agreement with fp32 and step cost, the decode/verify identity, the draft's agreement."""
    t = man.target
    rules, par, idn = t.source["quantization"]["rules"], t.parity["agreement_with_fp32"], t.parity["identity"]
    timing = man.build["timing"]["graphs"]
    lines = [f"wrote {out} ({t.precision} target, engine folder): TensorRT Q/DQ rules "
             f"{'passed' if rules['passed'] else 'FAILED'} ({rules['dequantize_nodes']} DequantizeLinear nodes)"]
    for g, r in par["graphs"].items():
        s = timing[g]
        lines.append(f"  {g:8s} top-1 {r['top1_agreement']:.3f}  mean KL {r['mean_kl']:.4f}  max|dlogit| "
                     f"{r['max_abs_logit_delta']:.3g}  step {s['qdq_ms']:.2f} ms vs fp32 {s['fp32_ms']:.2f} ms")
    lines.append(f"  all      top-1 {par['top1_agreement']:.3f} over {par['positions']} held-out positions")
    lines.append(f"  identity decode vs verify: {idn['argmax_flips']} argmax flips in {idn['rows']} rows, "
                 f"{idn['bitwise_equal_rows']} bit for bit")
    if man.draft is not None:
        ag = man.draft.parity["agreement_with_target"]
        lines.append(f"  draft    {man.draft.precision}, top-1 agreement with the Q/DQ target "
                     f"{ag['top1_agreement']:.3f}")
    return "\n".join(lines)


def _how(spec: QDQSpec, shapes: mf.Shapes, rules: dict, ranges: dict, counts: dict, prompts: int,
         source: str) -> dict:
    """The manifest's `models.target.source.quantization`: settings, rules check, decode
    graph form and the calibration (prompts, method, each weight's input range)."""
    return {**spec.settings(), "rules": rules,
            "decode_graph": f"the Q/DQ verify graph (T={shapes.k + 1}) behind a one-token interface ({shapes.k} "
                            "padding rows): plain decoding runs the verify pass's kernels, bit for bit",
            "calibration": {"prompts": prompts, "source": source, "regimes": counts,
                            "decode_steps_per_prompt": spec.decode_steps,
                            "method": "MinMax per weight-MatMul input, merged by weight over the regimes; "
                                      "the same scales in every graph",
                            "max_abs_input": {w: round(max(-lo, hi), 4) for w, (lo, hi) in ranges.items()}}}


def _checked_source(engines: Path) -> mf.Manifest:
    """The fp32 folder, checked as the runtime would (manifest, every file and hash)."""
    man = mf.load(engines)
    if man.target.precision != "fp32":
        raise ConfigError(f"{engines}: the target is {man.target.precision}; `specrt qdq` quantizes an fp32 "
                          "target: give the fp32 folder (`specrt build --precision fp32`)")
    if man.engines is not None:
        raise ConfigError(f"{engines} is a TensorRT build; give the ONNX folder it was built from")
    mf.check_files(man, engines, hashes=True)
    return man


def _refuse_overlap(engines: Path, path: Path, out) -> None:
    src = Path(os.path.abspath(engines))
    if path == src or src in path.parents or path in src.parents:
        raise BuildOutputError(f"--out {out} is the source folder {engines} or inside it (or holds it): the "
                               "source would be replaced; choose a new folder, e.g. --out artifacts/smollm2-int8-qdq")


def decode_graph(verify: onnx.ModelProto, rows: int) -> onnx.ModelProto:
    """The decode graph of a Q/DQ target: a copy of the quantized verify graph (T=k+1) behind
    a one-token interface (builder/gates/rows.py: k padding rows, row 0 kept).

    A Q/DQ graph exported for T=1 or T=2 rounds some rows differently from the T=k+1 graph
    (ONNX Runtime CPU picks other kernels for other row counts; a float difference of ~1e-5
    that crosses an int8 rounding step moves a whole quantum): on SmolLM2-135M, 192 rows,
    T=1 decode vs verify 10 argmax flips (max |delta logit| 9.3), T=2 8 flips (7.5), this graph
    0 flips and every row bit for bit, at ~1.1x the T=1 step (82 vs 90 ms, verify 100 ms)."""
    from onnx import helper

    from specrt.builder.gates.rows import one_token_interface
    copy = onnx.ModelProto()
    copy.CopyFrom(verify)
    g = copy.graph
    # returned K/V that the graph also reads (portable attention: cache ++ new rows): the
    # interface slices the graph outputs to one row, so the readers keep the T=k+1 tensor
    #   producer ─► X_full ─┬─► readers inside the graph
    #                       └─ Identity ─► X (graph output, sliced to one row by the interface)
    outs = {o.name for o in g.output if o.name.startswith(("new_k_", "new_v_"))}
    read = outs & {x for n in g.node for x in n.input}
    for n in g.node:
        n.input[:] = [f"{x}_full" if x in read else x for x in n.input]
        n.output[:] = [f"{x}_full" if x in read else x for x in n.output]
    g.node.extend(helper.make_node("Identity", [f"{x}_full"], [x], name=f"qdq.keep_{x}") for x in sorted(read))
    return one_token_interface(copy, rows)


def check_identity(model_dir: Path, part: dict, shapes: mf.Shapes, prompts: list[list[int]]) -> dict:
    """The build's greedy-identity check (builder/cpu.py _check_identity) on the Q/DQ target: every
    verify row must pick the decode row's token, or greedy speculation would not reproduce
    plain decoding. Refuses with a ParityError otherwise."""
    from specrt.builder.gates import identity
    r = identity.decode_verify_agreement(model_dir, part, shapes, prompts)
    r["plain_decoding"] = (f"the decode graph: the verify graph's T={shapes.k + 1} kernels behind a one-token "
                           f"interface; speculation verifies with the verify graph (T={shapes.k + 1})")
    r["guarantee"] = ("bit for bit: every verify row equals the decode row" if r["bitwise_equal"] else
                      "argmax on the calibration prompts (rows differ by rounding only)")
    if r["argmax_flips"]:
        raise ParityError(
            f"the int8 Q/DQ target's verify graph (T={shapes.k + 1}) picks another token than its decode graph "
            f"(T=1) at {r['argmax_flips']} of {r['rows']} positions (max |delta logit| "
            f"{r['max_abs_logit_delta']:.3g}): greedy speculative output would differ from plain decoding; "
            "the verify graph's rows depend on the other rows of the call here: rebuild the fp32 folder with "
            "another --k, or keep more MatMuls float (--keep-float, e.g. '.down,.qkv')")
    return r


def copy_tokenizer(man: mf.Manifest, engines: Path, out: Path) -> dict:
    """The source's tokenizer file, copied into `out`, with its hash checked again."""
    rel = man.tokenizer["file"]
    _copy(engines / rel, out / rel)
    digest = mf.sha256_file(out / rel)
    if digest != man.tokenizer["sha256"]:
        from specrt.errors import GraphFileError
        raise GraphFileError(f"{engines / rel} changed while it was copied (sha256 {digest[:12]}, the manifest "
                             f"says {man.tokenizer['sha256'][:12]}): run again")
    return {**man.tokenizer, "sha256": digest}


def copy_draft(man: mf.Manifest, engines: Path, out: Path, target: dict, prompts: list[list[int]]) -> dict:
    """The source's draft files copied into `out` under the same names, as a manifest part;
    its agreement with the Q/DQ target is measured again (what acceptance now follows)."""
    from specrt.builder.gates import measure
    d = man.draft
    sub = Path(d.weights["file"]).parent
    files = [d.weights["file"], *(g.file for g in d.graphs.values())]
    if str(sub) in ("", ".") or any(Path(f).parent != sub for f in files):
        raise ConfigError(f"{engines}: the draft's files {files} are not in one subfolder as `specrt build` "
                          "writes them: rebuild the fp32 folder")
    shared = d.shares_cache_with == "target"
    if shared:
        bad = [f"dims.{k} {d.dims.get(k)} vs {target['dims'].get(k)}" for k in _CACHE_DIMS
               if d.dims.get(k) != target["dims"].get(k)]
        bad += [f"kv.{k} {d.kv.get(k)!r} vs {target['kv'].get(k)!r}" for k in _CACHE_KV
                if d.kv.get(k) != target["kv"].get(k)]
        if bad:
            raise ConfigError(f"{engines}: the draft reads the target's KV cache, but the Q/DQ target's cache "
                              f"differs ({', '.join(bad)}): build the fp32 folder with a draft of its own "
                              "(--draft truncate:N or a draft model)")
    for f in files:
        _copy(engines / f, out / f)
    part = {"subdir": str(sub), "graphs": {g: {"file": Path(e.file).name, "tokens": e.tokens, "sha256": e.sha256}
                                           for g, e in d.graphs.items()},
            "weights": {**d.weights, "file": Path(d.weights["file"]).name}, "dims": d.dims, "family": d.family,
            "precision": d.precision, "source": d.source, "kv": dict(d.kv)}
    again = measure.draft_agreement(out / "target", target, out / sub, part, man.shapes, prompts,
                                    shared_cache=shared)
    old = d.parity.get("agreement_with_target")
    part["parity"] = {**d.parity, "agreement_with_target": again,
                      **({"agreement_with_fp32_target": old} if old else {})}
    return part


def _copy(src: Path, dst: Path) -> None:
    """A copy, not a hardlink: onnx refuses to read external data from a file with several
    hard links ("potential hardlink attack"), so a link would break `onnx.load` of the
    source's own graphs (quantizers, `specrt qdq` again) as well as this folder's."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(src, dst)


def _attention_ops(path: Path) -> list[str]:
    m = onnx.load(str(path), load_external_data=False)
    return sorted({f"{n.domain or 'ai.onnx'}.{n.op_type}" for n in m.graph.node
                   if n.op_type in ("GroupQueryAttention", "Attention", "Softmax", "TensorScatter")})

