"""`specrt build`: export -> calibration -> engines, into one folder with a manifest.

The build writes into `<out>.partial` and moves it into place only when every graph
passed parity, so a failed build never destroys the previous artifacts. This file is the
ONNX Runtime CPU build (`--backend ort-cpu`, the default); the GPU backends' builds are in
specrt/gpu_build.py, which also resolves `--backend auto`.
"""
from __future__ import annotations

import json
import logging
import shutil
import time
from pathlib import Path

from specrt.config import BuildConfig
from specrt.errors import TokenizerMismatchError

log = logging.getLogger(__name__)
# an INT8 copy that disagrees with its own fp32 source this often is broken, not just weak
MIN_INT8_AGREEMENT = 0.5


def build(cfg: BuildConfig, *, progress: bool = True, force: bool = False) -> Path:
    """Build into a fresh hidden sibling of `cfg.out` and swap it into place at the end
    (see specrt/outdir.py): a failed or interrupted build leaves `cfg.out` as it was, and
    nothing is deleted that specrt did not create (`force=True` replaces a folder that is
    not a previous build)."""
    from specrt import gpu_build, outdir
    from specrt.runtime.backends.ort_cpu import configure_threads
    cfg, choice = gpu_build.resolve(cfg, progress=progress)   # auto -> a backend; GPU refusals before any work
    out = outdir.preflight(cfg.out, force=force)     # before any long work
    configure_threads(cfg.threads)   # every session of the build (parity, agreement) runs on this pool
    tmp = outdir.make_partial(out)
    try:
        if cfg.backend == "ort-cpu":
            _build(cfg, out, tmp, progress, choice)
        else:
            gpu_build.build_gpu(cfg, out, tmp, progress, choice)
        outdir.commit(tmp, out)
    finally:
        outdir.discard(tmp)        # a failed build leaves nothing behind; `out` is untouched
    return Path(cfg.out)


def _build(cfg: BuildConfig, out: Path, tmp: Path, progress: bool, choice: dict) -> Path:
    from tqdm.auto import tqdm

    from specrt.calibration import int8, measure
    from specrt.engines import ort_cpu
    from specrt.export import onnx_export, parity, sources

    shapes, kind = cfg.shapes, cfg.draft_kind
    n_graphs = 3 + {"none": 0, "int8": 1, "int8-dynamic": 1, "truncate": 2, "model": 2}[kind]
    table = bool(cfg.ngram_tokens) and cfg.precision != "fp32"   # a two-row decode graph (checked below)
    bar = tqdm(total=n_graphs + 3 + (cfg.draft_vocab is not None) + table, desc="build", unit="step",
               disable=not progress)
    t_start = time.perf_counter()

    def step(msg):
        bar.set_postfix_str(msg)
        bar.update(1)

    bar.set_postfix_str("loading target")
    tgt = sources.load_source(cfg.target)
    step("target loaded")
    _check_window(tgt, shapes)
    dm = None
    if kind == "model":   # refuse a mismatched draft before the long export
        dm = sources.load_source(cfg.draft)
        _check_same_tokenizer(tgt, dm)
    # the fp32 export is the target itself, or the source of a quantized target (and of an int8 draft)
    fp32_dir = tmp / ("target" if cfg.precision == "fp32" else "_fp32")
    fp32 = onnx_export.export_model(tgt, shapes, fp32_dir, attention=cfg.attention,
                                    progress=lambda g: step(f"target {g} exported"))
    fp32["parity"] = parity.check_parity(tgt.model, fp32_dir, fp32, shapes, rtol=tgt.spec.parity_rtol)
    tok_info = _save_tokenizer(tgt, tmp)
    part = _quantized_target(cfg, tgt, fp32_dir, fp32, tmp / "target", _prompt_ids(tgt)) \
        if cfg.precision != "fp32" else fp32
    part["parity"]["identity"] = _check_identity(cfg, tmp / "target", part, _prompt_ids(tgt))
    part.update(subdir="target", family=tgt.spec.family, precision=cfg.precision,
                source={**tgt.identity, **part.pop("derived", {}), "tokenizer_sha256": tok_info["sha256"],
                        **({"export_fusions": fp32["fusions"]} if fp32.get("fusions") else {})},
                kv=_kv(cfg, None))
    parts = {"target": part}
    step("target parity checked")

    if kind in ("int8", "int8-dynamic"):
        method = "blockwise" if kind == "int8" else "dynamic"
        trim, prepare = None, None
        if cfg.draft_vocab is not None:   # the LM head cut to N columns before quantization
            from specrt.calibration import vocab
            bar.set_postfix_str("choosing the draft's vocabulary")
            ids, trim = _draft_vocab(cfg, tgt, fp32_dir, fp32, tok_info)
            prepare = {"decode": lambda m: vocab.trim_lm_head(m, ids)}
            step(f"draft vocabulary: {len(ids)} ids, held-out coverage {trim['held_out_coverage']}")
        d = int8.quantize_model(fp32_dir, fp32, tmp / "draft", graphs=("decode",), method=method, prepare=prepare)
        step("draft quantized")
        # the gate compares the draft with its own source, the fp32 export (a quantized target
        # differs from it by its own quantization error, which says nothing about the draft)
        agreement = measure.draft_agreement(fp32_dir, fp32, tmp / "draft", d, shapes, _prompt_ids(tgt),
                                            shared_cache=True)
        agreement["min_top1_agreement"] = MIN_INT8_AGREEMENT
        gate = agreement
        if trim:   # the gate checks the quantization: positions whose target token the draft can propose
            gate = agreement["draftable"] = vocab.draftable_agreement(fp32_dir, fp32, tmp / "draft", d, shapes,
                                                                      _prompt_ids(tgt), ids)
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
                tmp / "target", part, tmp / "draft", d, shapes, _prompt_ids(tgt), shared_cache=True)}
        how = d.pop("quantization")
        if trim:
            how["draft_vocab"] = trim
        d.update(subdir="draft", family=tgt.spec.family, precision="int8-" + method,
                 source={**tgt.identity, "derived": f"int8 ({method}) copy of the fp32 target" + (
                         f", LM head cut to {trim['kept']} of {trim['of']} tokens" if trim else ""),
                         "quantization": how, "tokenizer_sha256": tok_info["sha256"]},
                 kv=_kv(cfg, "target"))
        parts["draft"] = d
    elif kind in ("truncate", "model"):
        if kind == "truncate":
            dm, layers = tgt, cfg.truncate_layers
            if layers >= tgt.dims.layers:
                from specrt.errors import SpecrtError
                raise SpecrtError(f"draft={cfg.draft!r}: the target has only {tgt.dims.layers} layers")
            reference = _truncated_reference(tgt.model, layers)
            derived = {"derived": f"first {layers} of {tgt.dims.layers} target layers"}
        else:
            layers = None
            reference, derived = dm.model, {}
        d = onnx_export.export_model(dm, shapes, tmp / "draft", graphs=("prefill", "decode"), layers=layers,
                                     attention=cfg.attention, progress=lambda g: step(f"draft {g} exported"))
        d["parity"] = parity.check_parity(reference, tmp / "draft", d, shapes, rtol=dm.spec.parity_rtol)
        d["parity"]["agreement_with_target"] = measure.draft_agreement(
            tmp / "target", part, tmp / "draft", d, shapes, _prompt_ids(tgt), shared_cache=False)
        d.update(subdir="draft", family=dm.spec.family, precision="fp32",
                 source={**dm.identity, **derived, "tokenizer_sha256": tok_info["sha256"]},
                 kv=_kv(cfg, None))
        parts["draft"] = d
    proposers = {}
    if cfg.ngram_tokens and part["graphs"]["decode"]["tokens"] > 1:   # pair rounds: guesses where lookup has none
        from specrt.calibration import ngrams
        bar.set_postfix_str(f"n-gram table: generating {cfg.ngram_tokens} tokens")
        proposers["ngrams"] = ngrams.build(tgt, tmp / "target", part, shapes, tmp / "ngrams.json", cfg.ngram_tokens,
                                           set(tok_info["eos_token_ids"]))
        step(f"n-gram table: {proposers['ngrams']['entries']} entries")
    if fp32_dir.name == "_fp32":
        shutil.rmtree(fp32_dir)
    build_info = {"config": cfg.as_dict(), "backend": choice}
    if cfg.measure_costs:
        bar.set_postfix_str("timing the graphs")
        build_info["speculation"] = _speculation_plan(tmp, parts, shapes)
    build_info["seconds"] = round(time.perf_counter() - t_start, 1)
    ort_cpu.write_manifest(tmp, shapes, parts, tok_info, build_info, proposers=proposers)
    step("manifest written")
    bar.close()
    log.info("built %s in %.0fs", out, time.perf_counter() - t_start)
    return out


def _draft_vocab(cfg: BuildConfig, tgt, fp32_dir: Path, fp32: dict, tok_info: dict):
    """(kept ids, manifest record) for --draft-vocab N (calibration/vocab.py)."""
    from specrt.calibration import vocab
    from specrt.errors import ConfigError
    v = int(fp32["dims"]["vocab"])
    if cfg.draft_vocab >= v:
        raise ConfigError(f"--draft-vocab {cfg.draft_vocab} keeps all {v} tokens of the model: leave it out for the "
                          f"full LM head, or give fewer than {v}")
    special = {int(i) for i in tgt.tokenizer.all_special_ids} | set(tok_info["eos_token_ids"])
    return vocab.plan(fp32_dir, fp32, cfg.shapes, tgt.tokenizer, cfg.draft_vocab, sorted(i for i in special if i < v),
                      tok_info["eos_token_ids"])


def _speculation_plan(tmp: Path, parts: dict, shapes) -> dict:
    """Each built graph's step cost, and the predicted speedup of every k (calibration/plan.py):
    what adaptive k starts from at run time."""
    from specrt.calibration import plan
    d = parts.get("draft")
    costs = plan.step_costs(tmp / "target", parts["target"], tmp / "draft" if d else None, d, shapes)
    agreement = ((d or {}).get("parity") or {}).get("agreement_with_target", {}).get("top1_agreement")
    # a trimmed draft head never proposes a token outside its kept ids: the prompts the agreement
    # was measured on hold few of those, so scale by the held-out coverage (README "draft vocabulary")
    coverage = (((d or {}).get("source") or {}).get("quantization", {}).get("draft_vocab") or {}).get(
        "held_out_coverage")
    if agreement is not None and coverage:
        agreement *= float(coverage)
    return plan.plan(costs, agreement, shapes.k)


def _quantized_target(cfg: BuildConfig, tgt, fp32_dir: Path, fp32: dict, out_dir: Path, prompts) -> dict:
    """The target's prefill/decode/verify graphs quantized as cfg.precision says, with
    their agreement with the fp32 export measured on real prompts. With int8 compute the
    decode graph is exported for 2 rows (calibration/rows.py): a plain step pads one row, so
    plain decoding runs the verify pass's kernels and rounds exactly as it does, and a pair
    round verifies one guessed token in that row at no extra cost (runtime/loop.py)."""
    from specrt.calibration import identity, quantize, rows
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
                      "agreement_with_fp32": identity.target_agreement(fp32_dir, fp32, out_dir, part, cfg.shapes,
                                                                       prompts)}
    part["derived"] = {"derived": f"{cfg.precision} ({how['method']}, {how.get('bits')}-bit, block "
                                  f"{how.get('block_size')}, {how.get('compute')} compute, LM head "
                                  f"{'quantized' if how['lm_head_quantized'] else 'fp32'}) of the fp32 export",
                       "quantization": how}
    return part


def _check_identity(cfg: BuildConfig, model_dir: Path, part: dict, prompts) -> dict:
    """Greedy speculation reproduces plain decoding only if the verify graph's rows pick
    the tokens the one-token graph picks: refuse a target whose graphs disagree."""
    from specrt.calibration import identity
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


def _kv(cfg: BuildConfig, shares: str | None) -> dict:
    return {"dtype": "float32", "layout": "[batch, kv_heads, kv_capacity, head_dim]",
            "update": "in_place" if cfg.attention in ("gqa", "standard") else "returned", "shares_cache_with": shares}


def _check_window(lm, shapes) -> None:
    from specrt.errors import SpecrtError
    if shapes.kv_capacity > lm.dims.max_positions and lm.spec.positions == "learned":
        raise SpecrtError(f"max_context={shapes.max_context} + window exceeds the model's {lm.dims.max_positions} "
                          "learned positions: lower --max-context")
    if shapes.max_context > lm.dims.max_positions:
        raise SpecrtError(f"max_context={shapes.max_context} exceeds the model's max_position_embeddings="
                          f"{lm.dims.max_positions}: lower --max-context")
    # sliding windows are exported (the attention mask / GroupQueryAttention's local_window_size);
    # a rotary table that transformers swaps for another past some length is not
    for rope in (lm.identity.get("rope") or {}).values():
        limit = rope.get("max_context")
        if limit and shapes.max_context > limit:
            raise SpecrtError(f"the model's {rope['rope_type']} rotary embedding switches to its long-context "
                              f"factors beyond original_max_position_embeddings={limit} tokens, which a static "
                              f"graph cannot follow: use --max-context {limit} or less")


def _save_tokenizer(lm, out: Path) -> dict:
    from specrt import manifest as mf
    tok = lm.tokenizer
    tmp = out / "_tokenizer"
    tok.save_pretrained(str(tmp))
    path = out / "tokenizer.json"
    shutil.move(str(tmp / "tokenizer.json"), path)
    shutil.rmtree(tmp)
    eos = set()
    if tok.eos_token_id is not None:
        eos.add(int(tok.eos_token_id))
    gen_eos = getattr(getattr(lm.model, "generation_config", None), "eos_token_id", None)
    if gen_eos is not None:
        eos.update(int(i) for i in (gen_eos if isinstance(gen_eos, (list, tuple)) else [gen_eos]))
    return {"file": "tokenizer.json", "sha256": mf.sha256_file(path), "chat_template": tok.chat_template,
            "eos_token_ids": sorted(eos), "eos_token": tok.eos_token, "bos_token": tok.bos_token,
            "bos_token_id": tok.bos_token_id, "vocab_size": len(tok)}


def _check_same_tokenizer(a, b) -> None:
    va, vb = a.tokenizer.get_vocab(), b.tokenizer.get_vocab()
    if va != vb:
        only = len(set(va.items()) ^ set(vb.items()))
        raise TokenizerMismatchError(
            f"draft and target tokenizers differ ({len(va)} vs {len(vb)} entries, {only} mismatched): speculative "
            "decoding needs one shared vocabulary; pick a draft from the same model family")
    if a.dims.vocab != b.dims.vocab:
        raise TokenizerMismatchError(f"draft logits have {b.dims.vocab} entries, the target's {a.dims.vocab}: "
                                     "the vocabularies must be the same size")


def _truncated_reference(model, layers: int):
    """The first `layers` layers of `model`, sharing its weights; `model` is left whole
    (a shallow copy of a Module shares its submodule dict, so each level gets its own)."""
    import copy
    ref = copy.copy(model)             # shallow: shares weights
    ref._modules = dict(model._modules)
    ref.model = copy.copy(model.model)
    ref.model._modules = dict(model.model._modules)
    ref.model.layers = model.model.layers[:layers]
    ref.model.config = copy.copy(model.model.config)
    ref.model.config.num_hidden_layers = layers
    return ref


def _prompt_ids(lm) -> list[list[int]]:
    from specrt.prompts import PROMPTS
    tok = lm.tokenizer
    out = []
    for p in PROMPTS[:4]:
        text = tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True) \
            if tok.chat_template else p
        ids = tok(text, add_special_tokens=not tok.chat_template)["input_ids"]
        bad = [int(i) for i in ids if not 0 <= int(i) < lm.dims.vocab]
        if bad:
            from specrt.errors import TokenizerMismatchError
            raise TokenizerMismatchError(f"the tokenizer produced ids {bad[:3]} outside the model's vocabulary "
                                         f"({lm.dims.vocab}): the tokenizer does not belong to this model")
        out.append([int(i) for i in ids])
    return out


def describe(path: Path) -> str:
    from specrt import manifest as mf
    return json.dumps(json.loads((Path(path) / mf.FILENAME).read_text()), indent=2)
