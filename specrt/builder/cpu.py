"""The ONNX Runtime CPU build (`--backend ort-cpu`, the default), into the partial folder
builder/pipeline.py gives it:

    target: load ─ fp32 export ─ parity vs torch ─ [int8/int4: quantize, agreement with fp32]
            ─ decode vs verify identity (refused when greedy speculation would differ)
    draft:  int8 copy of the fp32 export [LM head cut, --draft-vocab] ─ agreement gate
            | truncate:N or a draft model: fp32 export ─ parity ─ agreement with the target
    [two-row decode graph: the n-gram table]  [measure_costs: the speculation plan]
    ─ manifest.json (manifest_writer.py)

The GPU backends' builds are in builder/gpu.py; what both share is in builder/steps.py.
"""
from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path

from specrt.builder import steps
from specrt.builder.config import BuildConfig

log = logging.getLogger(__name__)
# an INT8 copy that disagrees with its own fp32 source this often is broken, not just weak
MIN_INT8_AGREEMENT = 0.5


def build_cpu(cfg: BuildConfig, out: Path, tmp: Path, progress: bool, choice: dict) -> Path:
    from tqdm.auto import tqdm

    from specrt.builder import manifest_writer
    from specrt.builder.gates import identity, measure
    from specrt.calibration import int8
    from specrt.export import onnx_export, parity, sources
    from specrt.runtime.tokenizer import Tokenizer

    shapes, kind = cfg.shapes, cfg.draft_kind
    n_graphs = 3 + {"none": 0, "int8": 1, "int8-dynamic": 1, "truncate": 2, "model": 2}[kind]
    table = bool(cfg.ngram_tokens) and cfg.precision != "fp32"   # a two-row decode graph (checked below)
    batch_draft = cfg.batch and kind in ("truncate", "model")      # (counted even where it is left out)
    bar = tqdm(total=n_graphs + 3 + (cfg.draft_vocab is not None) + table + cfg.batch + batch_draft, desc="build",
               unit="step",
               disable=not progress)
    t_start = time.perf_counter()

    def step(msg):
        bar.set_postfix_str(msg)
        bar.update(1)

    bar.set_postfix_str("loading target")
    tgt = sources.load_source(cfg.target)
    step("target loaded")
    steps.check_window(tgt, shapes)
    dm = None
    if kind == "model":   # refuse a mismatched draft before the long export
        dm = sources.load_source(cfg.draft)
        steps.check_same_tokenizer(tgt, dm)
    # the fp32 export is the target itself, or the source of a quantized target (and of an int8 draft)
    fp32_dir = tmp / ("target" if cfg.precision == "fp32" else "_fp32")
    fp32 = onnx_export.export_model(tgt, shapes, fp32_dir, attention=cfg.attention,
                                    progress=lambda g: step(f"target {g} exported"))
    fp32["parity"] = parity.check_parity(tgt.model, fp32_dir, fp32, shapes, rtol=tgt.spec.parity_rtol)
    tok_info = steps.save_tokenizer(tgt, tmp)
    tok = Tokenizer(tmp, tok_info)        # the runtime's: the build's prompts are encoded as it encodes them
    prompts = steps.prompt_ids(tok, tgt.dims.vocab)
    # the fp32 export's greedy continuations: what a quantized target's one-row graphs, and (after
    # the manifest is written) what a --batch folder's requests run, are measured against
    refs = identity.fp32_reference(fp32_dir, fp32, shapes, prompts) if cfg.precision != "fp32" or cfg.batch else None
    part = _quantized_target(cfg, tgt, fp32_dir, fp32, tmp / "target", prompts, refs) \
        if cfg.precision != "fp32" else fp32
    part["parity"]["identity"] = _check_identity(cfg, tmp / "target", part, prompts)
    part.update(subdir="target", family=tgt.spec.family, precision=cfg.precision,
                source={**tgt.identity, **part.pop("derived", {}), "tokenizer_sha256": tok_info["sha256"],
                        **({"export_fusions": fp32["fusions"]} if fp32.get("fusions") else {})},
                kv=steps.kv(cfg, None))
    parts = {"target": part}
    step("target parity checked")
    if cfg.batch:     # the target with a batch dimension, for `specrt serve --max-num-seqs`
        from specrt.builder.gates import batch
        bar.set_postfix_str("exporting the batched target")
        parts["batch"] = batch.export(cfg, tgt, tmp, part, prompts)
        inv = parts["batch"]["parity"]["batch_invariance"]
        win = parts["batch"]["parity"]["window_invariance"]
        step(f"batched target: rows alone = together over {inv['rows']} rows x {inv['steps']} steps; "
             f"{'speculation inside a batch' if win['equal'] else 'plain steps only in a batch'}")

    if kind in ("int8", "int8-dynamic"):
        method = "blockwise" if kind == "int8" else "dynamic"
        trim, prepare = None, None
        if cfg.draft_vocab is not None:   # the LM head cut to N columns before quantization
            from specrt.builder.gates import vocab
            bar.set_postfix_str("choosing the draft's vocabulary")
            ids, trim = _draft_vocab(cfg, tgt, tok, fp32_dir, fp32, tok_info)
            prepare = {"decode": lambda m: vocab.trim_lm_head(m, ids)}
            step(f"draft vocabulary: {len(ids)} ids, held-out coverage {trim['held_out_coverage']}")
        d = int8.quantize_model(fp32_dir, fp32, tmp / "draft", graphs=("decode",), method=method, prepare=prepare)
        step("draft quantized")
        # the gate compares the draft with its own source, the fp32 export (a quantized target
        # differs from it by its own quantization error, which says nothing about the draft)
        agreement = measure.draft_agreement(fp32_dir, fp32, tmp / "draft", d, shapes, prompts,
                                            shared_cache=True)
        agreement["min_top1_agreement"] = MIN_INT8_AGREEMENT
        gate = agreement
        if trim:   # the gate checks the quantization: positions whose target token the draft can propose
            gate = agreement["draftable"] = vocab.draftable_agreement(fp32_dir, fp32, tmp / "draft", d, shapes,
                                                                      prompts, ids)
            agreement["max_abs_logit_delta"] = gate["max_abs_logit_delta"]   # over the kept ids, not inf
        if gate["top1_agreement"] < MIN_INT8_AGREEMENT:
            from specrt.errors import ParityError
            raise ParityError(
                f"the {method} INT8 draft agrees with the target on only {gate['top1_agreement']:.1%} of "
                f"positions{' it can draft' if trim else ''} (tolerance: at least {MIN_INT8_AGREEMENT:.0%}); the "
                "quantization is broken for this model: try --draft int8-dynamic, another draft, or --draft none")
        d["parity"] = {"agreement_with_target": agreement}
        if cfg.precision != "fp32":   # what acceptance follows: agreement with the quantized target itself
            d["parity"] = {"agreement_with_fp32_target": agreement, "agreement_with_target": measure.draft_agreement(
                tmp / "target", part, tmp / "draft", d, shapes, prompts, shared_cache=True)}
        how = d.pop("quantization")
        if trim:
            how["draft_vocab"] = trim
        d.update(subdir="draft", family=tgt.spec.family, precision="int8-" + method,
                 source={**tgt.identity, "derived": f"int8 ({method}) copy of the fp32 target" + (
                         f", LM head cut to {trim['kept']} of {trim['of']} tokens" if trim else ""),
                         "quantization": how, "tokenizer_sha256": tok_info["sha256"]},
                 kv=steps.kv(cfg, "target"))
        parts["draft"] = d
    elif kind in ("truncate", "model"):
        if kind == "truncate":
            dm, layers = tgt, cfg.truncate_layers
            if layers >= tgt.dims.layers:
                from specrt.errors import SpecrtError
                raise SpecrtError(f"draft={cfg.draft!r}: the target has only {tgt.dims.layers} layers")
            reference = steps.truncated_reference(tgt.model, layers)
            derived = {"derived": f"first {layers} of {tgt.dims.layers} target layers"}
        else:
            layers = None
            reference, derived = dm.model, {}
        d = onnx_export.export_model(dm, shapes, tmp / "draft", graphs=("prefill", "decode"), layers=layers,
                                     attention=cfg.attention, progress=lambda g: step(f"draft {g} exported"))
        d["parity"] = parity.check_parity(reference, tmp / "draft", d, shapes, rtol=dm.spec.parity_rtol)
        d["parity"]["agreement_with_target"] = measure.draft_agreement(
            tmp / "target", part, tmp / "draft", d, shapes, prompts, shared_cache=False)
        d.update(subdir="draft", family=dm.spec.family, precision="fp32",
                 source={**dm.identity, **derived, "tokenizer_sha256": tok_info["sha256"]},
                 kv=steps.kv(cfg, None))
        parts["draft"] = d
        if cfg.batch:     # the draft model inside the batch: its own cache per row
            from specrt.builder.gates import batch
            bar.set_postfix_str("exporting the batched draft")
            bd = batch.export_draft(cfg, dm, layers, tmp, parts["batch"], d, prompts)
            if bd is not None:
                parts["batch_draft"] = bd
                step(f"batched draft: top-1 agreement with the batched target "
                     f"{bd['parity']['draft_agreement']['top1_agreement']:.2f}")
    proposers = {}
    if cfg.ngram_tokens and part["graphs"]["decode"]["tokens"] > 1:   # pair rounds: guesses where lookup has none
        from specrt.builder.gates import ngrams
        bar.set_postfix_str(f"n-gram table: generating {cfg.ngram_tokens} tokens")
        proposers["ngrams"] = ngrams.build(tok, tmp / "target", part, shapes, tmp / "ngrams.json", cfg.ngram_tokens,
                                           set(tok_info["eos_token_ids"]))
        step(f"n-gram table: {proposers['ngrams']['entries']} entries")
    if fp32_dir.name == "_fp32":
        shutil.rmtree(fp32_dir)
    build_info = {"config": cfg.as_dict(), "backend": choice}
    from specrt.builder.gates import quiet
    with quiet.cpu_share(cfg.threads, "specrt build") as timed:     # was the machine free while timing?
        if cfg.measure_costs:
            bar.set_postfix_str("timing the graphs")
            build_info["speculation"] = _speculation_plan(tmp, parts, shapes)
            if cfg.batch:     # what each batched step costs per rows x T: speculation chosen per step
                from specrt.builder.gates import batch_costs
                build_info["speculation"]["batch_costs_ms"] = batch_costs.costs(tmp, parts["batch"], shapes,
                                                                                draft_part=parts.get("batch_draft"))
        man = manifest_writer.assemble_manifest(shapes, parts, tok_info, build_info, proposers=proposers)
        if cfg.measure_costs:     # the kernel families at the shapes the runtime runs (builder/gates/kernels.py)
            from specrt.builder.gates import kernels
            bar.set_postfix_str("kernel table")
            try:
                man.build["kernels"] = kernels.measure(tmp, man, progress=bar.set_postfix_str)
            except Exception as e:      # a table that informs --precision never fails the build it describes
                log.warning("the kernel table could not be measured (%s: %s); the folder is built without it "
                            "(`specrt retime` measures it again)", type(e).__name__, e)
                man.build["kernels"] = {"error": f"{type(e).__name__}: {e}"}
    if cfg.measure_costs:
        man.build["speculation"]["conditions"] = timed
        if quiet.warning(timed):
            log.warning("%s", quiet.warning(timed))
    if cfg.batch:     # the vs-fp32 figure of what every request runs: the batched model, loaded as served
        manifest_writer.save_manifest(man, tmp)          # (files and hashes checked once, here)
        bar.set_postfix_str("the batched model against fp32")
        man.models["batch"].parity["agreement_with_fp32"] = identity.requests_agreement(tmp, refs, cfg.threads)
        man.build["seconds"] = round(time.perf_counter() - t_start, 1)
        man.save(tmp)
    else:
        man.build["seconds"] = round(time.perf_counter() - t_start, 1)
        manifest_writer.save_manifest(man, tmp)
    step("manifest written")
    bar.close()
    log.info("built %s in %.0fs", out, time.perf_counter() - t_start)
    return out


def _draft_vocab(cfg: BuildConfig, tgt, tok, fp32_dir: Path, fp32: dict, tok_info: dict):
    """(kept ids, manifest record) for --draft-vocab N (builder/gates/vocab.py)."""
    from specrt.builder.gates import vocab
    from specrt.errors import ConfigError
    v = int(fp32["dims"]["vocab"])
    if cfg.draft_vocab >= v:
        raise ConfigError(f"--draft-vocab {cfg.draft_vocab} keeps all {v} tokens of the model: leave it out for the "
                          f"full LM head, or give fewer than {v}")
    special = {int(i) for i in tgt.tokenizer.all_special_ids} | set(tok_info["eos_token_ids"])
    return vocab.plan(fp32_dir, fp32, cfg.shapes, tok, cfg.draft_vocab, sorted(i for i in special if i < v),
                      tok_info["eos_token_ids"])


def _speculation_plan(tmp: Path, parts: dict, shapes) -> dict:
    """Each built graph's step cost, and the predicted speedup of every k (builder/gates/plan.py):
    what adaptive k starts from at run time."""
    from specrt.builder.gates import plan
    d = parts.get("draft")
    costs = plan.step_costs(tmp / "target", parts["target"], tmp / "draft" if d else None, d, shapes)
    return plan.plan(costs, plan.draft_acceptance(d), shapes.k)


def _quantized_target(cfg: BuildConfig, tgt, fp32_dir: Path, fp32: dict, out_dir: Path, prompts, refs) -> dict:
    """The target's prefill/decode/verify graphs quantized as cfg.precision says, with
    their agreement with the fp32 export measured on real prompts. With int8 compute the
    decode graph is exported for 2 rows (builder/gates/rows.py): a plain step pads one row, so
    plain decoding runs the verify pass's kernels and rounds exactly as it does, and a pair
    round verifies one guessed token in that row at no extra cost (runtime/batch/engine.py)."""
    from specrt.builder.gates import identity, rows
    from specrt.calibration import quantize
    from specrt.export import onnx_export
    spec = quantize.QuantSpec(**cfg.target_quantization)
    source, wide = fp32, spec.accuracy_level == 4
    if wide:
        name = f"decode_rows{rows.ROWS}.onnx"
        module = onnx_export.build_module(tgt, rows.ROWS, cfg.shapes.kv_capacity, attention=cfg.attention)
        onnx_export.export_graph(module, fp32_dir / name)
        source = {**fp32, "graphs": {**fp32["graphs"], "decode": {"file": name, "tokens": rows.ROWS}}}
    part = quantize.quantize_graphs(fp32_dir, source, out_dir, ("prefill", "decode", "verify"), spec)
    how = part.pop("quantization")
    how["decode_graph"] = (f"exported for T={rows.ROWS}: a plain step pads one row and runs the multi-row "
                           "int8-compute kernels of the verify pass; a pair round verifies one guessed token "
                           "in the second row at the same cost" if wide else "exported for T=1")
    # the export's parity vs torch describes the fp32 graphs, not these: kept, but under its own key
    part["parity"] = {"fp32_export": fp32["parity"],
                      "agreement_with_fp32": identity.target_agreement(refs, out_dir, part, cfg.shapes)}
    kind = (f"{how.get('bits')}-bit, block {how.get('block_size')}, {how.get('compute')} compute"
            if spec.method == "matmulnbits" else f"{how['weight_range']} per channel, {how['activations']}")
    part["derived"] = {"derived": f"{cfg.precision} ({how['method']}, {kind}, LM head "
                                  f"{'quantized' if how['lm_head_quantized'] else 'fp32'}) of the fp32 export",
                       "quantization": how}
    return part


def _check_identity(cfg: BuildConfig, model_dir: Path, part: dict, prompts) -> dict:
    """Greedy speculation reproduces plain decoding only if the verify graph's rows pick
    the tokens the one-token graph picks: refuse a target whose graphs disagree."""
    from specrt.builder.gates import identity
    from specrt.errors import ParityError
    r = identity.decode_verify_agreement(model_dir, part, cfg.shapes, prompts)
    q = cfg.target_quantization
    r["plain_decoding"] = ("the decode graph: T=2 kernels, one padding row (as the verify graph's rows)"
                           if q and q.get("accuracy_level") == 4 else "the decode graph (T=1)") \
        + f"; speculation verifies with the verify graph (T={cfg.k + 1})"
    r["guarantee"] = ("bit for bit: every verify row equals the decode row" if r["bitwise_equal"] else
                      "argmax on the calibration prompts (rows differ by rounding only)")
    if r["argmax_flips"]:
        if q is None:   # fp32: T=1 and T=k+1 kernels differ by float rounding (~1e-4), here at a near-tie
            fix = ("the fp32 graphs round a near-tie differently; rebuild with another --k or --precision int8 "
                   "(plain decoding then runs the verify pass's kernels and agrees bit for bit)")
        elif q.get("method") == "rowwise":
            fix = ("rebuild with another --k, or --precision int8 / int4 / fp32 (int8row's rows are quantized "
                   "one by one, so this is a near-tie the verify and decode kernels round apart)")
        elif q.get("accuracy_level") != 4:
            fix = ("rebuild with --accuracy-level 4 (int8 compute; plain decoding then runs the verify pass's "
                   "multi-row kernels and agrees bit for bit) or --precision fp32")
        else:
            fix = "rebuild with --accuracy-level 1 (fp32 compute, rows differ by float rounding only) or --precision fp32"
        raise ParityError(
            f"the {cfg.precision} target's verify graph (T={cfg.k + 1}) picks another token than its decode graph "
            f"(T=1) at {r['argmax_flips']} of {r['rows']} positions (max |delta logit| "
            f"{r['max_abs_logit_delta']:.3g}): greedy speculative output would differ from plain decoding; {fix}")
    return r
