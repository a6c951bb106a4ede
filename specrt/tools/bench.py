"""`specrt bench`: plain vs speculative decoding on the same prompts, interleaved in one
run (the machines are shared and noisy: only ratios measured side by side mean
anything). Several engine folders (e.g. fp32 / int8 / int4 targets) are loaded into one
process and interleaved prompt by prompt, so their ratios are comparable. Prints tokens/s
of each, their ratios, acceptance, the speedup predicted from the measured step costs
next to the measured one, and whether each folder's speculative output was
token-for-token its own plain output. The methods run on the folder's one-row graphs; on a
`--batch` folder, what `specrt generate` runs instead (its batched model as a batch of one,
runtime/one.py) is timed beside them, interleaved, as one more column."""
from __future__ import annotations

import time
from typing import Callable, Sequence

from specrt.prompts import PROMPTS
from specrt.runtime import SamplingParams, SpeculativeGenerator
from specrt.runtime.costs import expected_tokens
from specrt.runtime.one import one_engine


def _run(gen: SpeculativeGenerator, ids: list[int], n: int, sampling, method: str, ngram: int = 2):
    """method: "plain", "speculative" (a fixed k: what the prediction describes), "adaptive"
    (speculative with adaptive k and prompt lookup, as the generator runs it by default when
    the build measured its costs) or "lookup"."""
    eos = gen.tokenizer.eos_token_ids
    toks = []
    adaptive = None if method in ("plain", "lookup") else method == "adaptive"
    method = "speculative" if method == "adaptive" else method
    if method == "speculative" and gen.draft is None:
        method, adaptive = "lookup", None   # engines built with --draft none: prompt lookup is their speculation
    for e in gen.tokens(ids, max_new_tokens=n, sampling=sampling, method=method, ngram=ngram, adaptive=adaptive):
        toks.append(e.token)
        if e.token in eos:
            break
    m = gen.last_metrics
    return toks, m.time_total - m.time_prefill, m


def _run_engine(gen: SpeculativeGenerator, ids: list[int], n: int, sampling):
    """What `specrt generate` runs on this folder: its batched model as a batch of one, with the
    default method (runtime/one.py), to its first EOS."""
    eos = gen.tokenizer.eos_token_ids
    toks = []
    for e in gen.tokens(ids, max_new_tokens=n, sampling=sampling):
        toks.append(e.token)
        if e.token in eos:
            break
    m = gen.last_metrics
    return toks, m.time_total - m.time_prefill, m


def _run_lookup(gen: SpeculativeGenerator, ids: list[int], n: int, ngram: int):
    """Greedy prompt lookup (the generator's method="lookup") on the same graphs."""
    return _run(gen, ids, n, SamplingParams(), "lookup", ngram=ngram)


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc; elsewhere the peak from getrusage)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def memory_report(gen: SpeculativeGenerator, rss_before: int = 0) -> dict:
    """rss_before: RSS before this generator was loaded; with several folders in one
    process, a folder's share is the growth its sessions caused (loaded and run)."""
    weights = sum(m.entry.weights["bytes"] for m in (gen.target, gen.draft) if m is not None)
    kv = gen.target.cache.nbytes + (gen.draft.cache.nbytes if gen.draft and gen.draft.cache is not gen.target.cache else 0)
    rss = rss_bytes() - rss_before
    return {"rss_bytes": rss, "weight_bytes": weights, "target_weight_bytes": gen.target.entry.weights["bytes"],
            "kv_bytes": kv, "rss_over_weights": rss / weights,
            "sessions": sum(len(m.graphs) for m in (gen.target, gen.draft) if m is not None)}


def predicted_speedup(plain, spec, k: int) -> dict:
    """E(a,k) * t_target(1) / (k * t_draft(1) + t_target(k+1)), from the step costs measured
    in this run (plain and speculative Metrics summed over the prompts)."""
    t1 = plain.time_verify / max(plain.iterations, 1)         # one decode step of the target
    tv = spec.time_verify / max(spec.iterations, 1)           # one verify pass (T = k+1)
    td = spec.time_draft / max(spec.drafted, 1)               # one draft token
    a = spec.accepted / spec.drafted if spec.drafted else 0.0
    cost = k * td + tv
    return {"t_target_1_ms": 1e3 * t1, "t_target_k1_ms": 1e3 * tv, "t_draft_1_ms": 1e3 * td,
            "verify_over_decode": tv / t1 if t1 else 0.0, "draft_over_decode": td / t1 if t1 else 0.0,
            "expected_tokens": expected_tokens(a, k), "predicted_speedup": expected_tokens(a, k) * t1 / cost if cost else 0.0}


class _Sum:
    """Metrics summed over prompts (only the fields predicted_speedup reads)."""

    def __init__(self):
        self.time_verify = self.time_draft = 0.0
        self.iterations = self.drafted = self.accepted = 0
        self.plain_steps = self.lookup_rounds = self.pair_rounds = 0

    def add(self, m) -> None:
        self.time_verify += m.time_verify
        self.time_draft += m.time_draft
        self.iterations += m.iterations
        self.drafted += m.drafted
        self.accepted += m.accepted


class _Variant:
    def __init__(self, engines: str, gen: SpeculativeGenerator, mem: dict, texts: list[str]):
        self.engines, self.gen, self.mem = engines, gen, mem
        t = gen.manifest.target
        self.precision = t.precision
        self.agreement = (t.parity or {}).get("agreement_with_fp32", {}).get("top1_agreement")
        chat = bool(gen.tokenizer.chat_template)
        self.prompt_ids = [gen.encode_prompt(p, chat=chat) for p in texts]
        self.rows: list[dict] = []
        self.plain_out: list[list[int]] = []
        self.t = {"plain": 0.0, "speculative": 0.0}
        self.n = {"plain": 0, "speculative": 0}
        self.sums = {"plain": _Sum(), "speculative": _Sum(), "lookup": _Sum(), "adaptive": _Sum()}
        self.t["lookup"], self.n["lookup"] = 0.0, 0
        self.t["adaptive"], self.n["adaptive"] = 0.0, 0
        self.identical = True
        self.lookup_identical = True
        # adaptive k runs where the build measured its costs (manifest build.speculation)
        self.adaptive = gen.costs is not None and gen.draft is not None
        self.adaptive_identical = True
        self.plan = (gen.manifest.build or {}).get("speculation", {}).get("chosen")
        # a --batch folder's one engine (what generate, the API and the server run), timed beside
        # the one-row graphs: set by run_bench
        self.one: SpeculativeGenerator | None = None
        self.t["engine"], self.n["engine"], self.engine_same = 0.0, 0, 0


def run_bench(engines: str | Sequence[str], *, prompts: int = 8, max_new_tokens: int = 128, rounds: int = 1,
              k: int | None = None, threads: int = 2, sampling: SamplingParams | None = None,
              hf_reference: str | None = None, memory: str = "fast", lookup: int = 0,
              out: Callable[[str], None] = print) -> dict:
    """lookup: also run greedy prompt lookup with this n-gram size (0: not run)."""
    if not isinstance(lookup, int) or lookup < 0:
        from specrt.errors import SpecrtError
        raise SpecrtError(f"lookup={lookup!r}: give the n-gram size of prompt lookup (1, 2, ...) or 0 for none")
    sampling = sampling or SamplingParams()
    lookup = lookup if sampling.greedy else 0
    folders = [str(engines)] if isinstance(engines, (str, bytes)) or not isinstance(engines, Sequence) \
        else [str(e) for e in engines]
    if not sampling.greedy:    # without a draft, the speculative column is prompt lookup: greedy only
        from specrt import manifest as mf
        from specrt.errors import ConfigError
        for e in folders:
            if mf.load(e).draft is None:
                raise ConfigError(f"{e} was built without a draft model (--draft none): there its speculative "
                                  "column is prompt lookup, which is greedy only: bench it with --temperature 0, "
                                  "or rebuild with a draft (`specrt build ... --draft int8`)")
    texts = (PROMPTS * (1 + prompts // len(PROMPTS)))[:prompts]
    variants = []
    for folder in folders:                   # load and warm one at a time: each one's RSS is its own growth
        before = rss_bytes()
        # the one-row graphs in any folder (engine="one-row"): the methods this table compares run there
        gen = SpeculativeGenerator(folder, k=k, threads=threads, memory=memory, engine="one-row")
        v = _Variant(folder, gen, {}, texts)
        _run(gen, v.prompt_ids[0], 8, sampling, "plain")           # warm-up: first-run allocations
        _run(gen, v.prompt_ids[0], 8, sampling, "speculative")
        v.mem = memory_report(gen, before)
        if one_engine(gen.manifest):
            v.one = SpeculativeGenerator(folder, k=k, threads=threads)
            _run_engine(v.one, v.prompt_ids[0], 8, sampling)
        variants.append(v)
        out(f"memory ({memory}) {folder}: {v.precision} target, RSS +{v.mem['rss_bytes'] / 2**20:.0f} MiB with "
            f"{v.mem['sessions']} sessions loaded and run | weights on disk {v.mem['weight_bytes'] / 2**20:.0f} MiB "
            f"(target {v.mem['target_weight_bytes'] / 2**20:.0f} MiB; RSS x{v.mem['rss_over_weights']:.2f}) | "
            f"KV cache {v.mem['kv_bytes'] / 2**20:.0f} MiB")
    multi = len(variants) > 1
    name_w = max(len(v.engines) for v in variants)
    out(f"{'prompt':>6} " + (f"{'engines':<{name_w}} " if multi else "")
        + f"{'plain tok/s':>12} {'spec tok/s':>11} {'ratio':>6} {'accept':>7} {'len':>5} identical")
    for r in range(rounds):
        for i in range(len(texts)):
            shift = (i + r) % len(variants)
            for v in variants[shift:] + variants[:shift]:
                _bench_prompt(v, i, r, max_new_tokens, sampling, out, name_w if multi else 0, lookup)
    return _summary(variants, folders, sampling, max_new_tokens, prompts, rounds, hf_reference, threads, out,
                    lookup)


def _bench_prompt(v: _Variant, i: int, r: int, max_new_tokens: int, sampling, out, name_w: int,
                  lookup: int) -> None:
    ids = v.prompt_ids[i]
    order = ("plain", "speculative") + (("adaptive",) if v.adaptive else ()) + (("engine",) if v.one else ())
    shift = (i + r) % len(order)
    res = {m: _run_engine(v.one, ids, max_new_tokens, sampling) if m == "engine" else
           _run(v.gen, ids, max_new_tokens, sampling, m) for m in order[shift:] + order[:shift]}
    if v.one:
        eng = res.pop("engine")
        v.t["engine"] += eng[1]
        v.n["engine"] += len(eng[0])
        v.engine_same += eng[0] == res["plain"][0]
    if v.adaptive:
        v.adaptive_identical &= res["adaptive"][0] == res["plain"][0]
    if lookup:
        res["lookup"] = _run_lookup(v.gen, ids, max_new_tokens, lookup)
        v.lookup_identical &= res["lookup"][0] == res["plain"][0]
    (tp, dp, _), (ts, ds, ms) = res["plain"], res["speculative"]
    same = tp == ts
    if v.adaptive:
        ma = res["adaptive"][2]
        v.sums["adaptive"].plain_steps += ma.plain_steps
        v.sums["adaptive"].lookup_rounds += ma.lookup_rounds
        v.sums["adaptive"].pair_rounds += ma.pair_rounds
    v.identical &= same
    for m, (toks, dt, met) in res.items():
        v.t[m] += dt
        v.n[m] += len(toks)
        v.sums[m].add(met)
    if r == 0:
        v.plain_out.append(tp)
    row = {"prompt": i, "round": r, "plain_tok_s": len(tp) / dp, "spec_tok_s": len(ts) / ds, "identical": same,
           "acceptance_rate": ms.acceptance_rate, "mean_acceptance_length": ms.mean_acceptance_length,
           "tokens": len(ts)}
    if v.adaptive:
        row["adaptive_tok_s"] = len(res["adaptive"][0]) / res["adaptive"][1]
        row["adaptive_identical"] = res["adaptive"][0] == tp
    if lookup:
        row["lookup_tok_s"] = len(res["lookup"][0]) / res["lookup"][1]
        row["lookup_identical"] = res["lookup"][0] == tp
    v.rows.append(row)
    out(f"{i:>6} " + (f"{v.engines:<{name_w}} " if name_w else "")
        + f"{row['plain_tok_s']:>12.1f} {row['spec_tok_s']:>11.1f} "
        f"{row['spec_tok_s'] / row['plain_tok_s']:>6.2f} {ms.acceptance_rate:>7.1%} "
        f"{ms.mean_acceptance_length:>5.2f} {'yes' if same else 'NO'}")


def _summary(variants, folders, sampling, max_new_tokens, prompts, rounds, hf_reference, threads, out,
             lookup: int = 0) -> dict:
    ref = variants[0]
    reports = []
    for v in variants:
        s_plain, s_spec = v.sums["plain"], v.sums["speculative"]
        plain_tps, spec_tps = v.n["plain"] / v.t["plain"], v.n["speculative"] / v.t["speculative"]
        same_as_ref = sum(a == b for a, b in zip(v.plain_out, ref.plain_out))
        reports.append({
            "engines": v.engines, "precision": v.precision, "k": v.gen.k, "plain_tok_s": plain_tps,
            "spec_tok_s": spec_tps, "speedup": spec_tps / plain_tps,
            "acceptance_rate": s_spec.accepted / s_spec.drafted if s_spec.drafted else 0.0,
            "mean_acceptance_length": 1 + s_spec.accepted / s_spec.iterations if s_spec.iterations else 0.0,
            "identical": v.identical, "plain_same_as_first_folder": same_as_ref,
            "top1_agreement_with_fp32": v.agreement,
            "prediction": predicted_speedup(s_plain, s_spec, v.gen.k), "rows": v.rows, "memory": v.mem,
        })
        if v.adaptive:
            sa = v.sums["adaptive"]
            reports[-1]["adaptive"] = {
                "tok_s": v.n["adaptive"] / v.t["adaptive"], "speedup": v.n["adaptive"] / v.t["adaptive"] / plain_tps,
                "identical": v.adaptive_identical, "build_plan": v.plan,
                "plain_step_share": sa.plain_steps / sa.iterations if sa.iterations else 0.0,
                "lookup_round_share": sa.lookup_rounds / sa.iterations if sa.iterations else 0.0,
                "pair_round_share": sa.pair_rounds / sa.iterations if sa.iterations else 0.0,
                "mean_acceptance_length": 1 + sa.accepted / sa.iterations if sa.iterations else 0.0}
        if v.one:
            tps = v.n["engine"] / v.t["engine"]
            reports[-1]["engine"] = {"tok_s": tps, "over_one_row_plain": tps / plain_tps,
                                     "over_one_row_speculative": tps / spec_tps,
                                     "over_one_row_adaptive": (tps / (v.n["adaptive"] / v.t["adaptive"])
                                                               if v.adaptive else None),
                                     "same_as_one_row_plain": v.engine_same, "of": len(v.rows)}
        if lookup:
            sl = v.sums["lookup"]
            reports[-1]["lookup"] = {"ngram": lookup, "tok_s": v.n["lookup"] / v.t["lookup"],
                                     "speedup": v.n["lookup"] / v.t["lookup"] / plain_tps,
                                     "identical": v.lookup_identical,
                                     "mean_acceptance_length": 1 + sl.accepted / sl.iterations if sl.iterations else 0.0}
    base = reports[0]["plain_tok_s"]
    greedy = sampling.greedy
    report = {"greedy": greedy, "max_new_tokens": max_new_tokens, "prompts": prompts, "rounds": rounds,
              "identical": all(r["identical"] and r.get("lookup", {}).get("identical", True)
                               and r.get("adaptive", {}).get("identical", True) for r in reports),
              "variants": reports,
              # the first folder's figures at the top level, as a one-folder bench always reported them
              **{key: reports[0][key] for key in ("engines", "k", "plain_tok_s", "spec_tok_s", "speedup",
                                                  "acceptance_rate", "mean_acceptance_length", "rows", "memory")}}
    if len(reports) == 1:
        r = reports[0]
        p = r["prediction"]
        out(f"\nplain {r['plain_tok_s']:.1f} tok/s | speculative {r['spec_tok_s']:.1f} tok/s | speedup "
            f"x{r['speedup']:.2f} (predicted x{p['predicted_speedup']:.2f}) | acceptance {r['acceptance_rate']:.1%} | "
            f"mean acceptance length {r['mean_acceptance_length']:.2f} | "
            + (f"outputs identical: {'yes' if r['identical'] else 'NO'}" if greedy
               else "sampled (outputs differ by design)"))
    else:
        w = max(len(f) for f in folders)
        out(f"\n{'engines':<{w}} {'prec':<5} {'plain':>7} {'spec':>7} {'spec/':>6} {'plain':>6} {'spec':>6} "
            f"{'pred':>6} {'accept':>7} {'len':>5} {'t1':>6} {'tk+1':>6} {'tdraft':>6} {'top1':>5} "
            f"{'=1st':>5} identical")
        out(f"{'':<{w}} {'':<7} {'tok/s':>7} {'tok/s':>7} {'plain':>6} {'x1st':>6} {'x1st':>6} "
            f"{'spec/pl':>6} {'':>7} {'':>5} {'ms':>6} {'ms':>6} {'ms':>6} {'fp32':>5} {'plain':>5}")
        for r in reports:
            p = r["prediction"]
            top1 = "-" if r["top1_agreement_with_fp32"] is None else f"{r['top1_agreement_with_fp32']:.2f}"
            out(f"{r['engines']:<{w}} {r['precision']:<7} {r['plain_tok_s']:>7.1f} {r['spec_tok_s']:>7.1f} "
                f"{r['speedup']:>6.2f} {r['plain_tok_s'] / base:>6.2f} {r['spec_tok_s'] / base:>6.2f} "
                f"{p['predicted_speedup']:>6.2f} {r['acceptance_rate']:>7.1%} {r['mean_acceptance_length']:>5.2f} "
                f"{p['t_target_1_ms']:>6.1f} {p['t_target_k1_ms']:>6.1f} {p['t_draft_1_ms']:>6.1f} {top1:>5} "
                f"{r['plain_same_as_first_folder']:>2}/{len(ref.plain_out):<2} "
                + (("yes" if r["identical"] else "NO") if greedy else "sampled"))
        out("(x1st: tok/s over the first folder's plain tok/s; pred: E(a,k) t1 / (k tdraft + tk+1) from this run's "
            "step costs; top1 fp32: teacher-forced agreement recorded at build; =1st plain: prompts whose plain "
            "output equals the first folder's)")
    for r in reports:
        if "adaptive" in r:
            ad, plan = r["adaptive"], r["adaptive"]["build_plan"] or {}
            out(f"adaptive k + prompt lookup {r['engines']}: {ad['tok_s']:.1f} tok/s, x{ad['speedup']:.2f} over its "
                f"plain (build plan: {plan.get('method')} k={plan.get('k')}, predicted x"
                f"{plan.get('predicted_speedup', 0):.2f}) | plain steps {ad['plain_step_share']:.0%}, pair rounds "
                f"{ad['pair_round_share']:.0%}, lookup rounds {ad['lookup_round_share']:.0%} of target passes, "
                f"{ad['mean_acceptance_length']:.2f} tokens per pass | "
                + (("identical to plain: " + ("yes" if ad["identical"] else "NO")) if greedy else "sampled"))
        if "lookup" in r:
            lk = r["lookup"]
            out(f"prompt lookup n={lk['ngram']} (measured) {r['engines']}: {lk['tok_s']:.1f} tok/s, x{lk['speedup']:.2f} "
                f"over its plain, {lk['mean_acceptance_length']:.2f} tokens per target pass, identical to plain: "
                + ("yes" if lk["identical"] else "NO"))
        if "engine" in r:
            en = r["engine"]
            out(f"what generate runs on {r['engines']} (its batched model, a batch of one): {en['tok_s']:.1f} tok/s, "
                f"x{en['over_one_row_plain']:.2f} over the one-row plain, x{en['over_one_row_speculative']:.2f} over "
                f"the one-row speculative"
                + (f", x{en['over_one_row_adaptive']:.2f} over the one-row adaptive" if en["over_one_row_adaptive"]
                   else "")
                + (f" | the one-row plain tokens: {en['same_as_one_row_plain']}/{en['of']} (other graphs: rounding "
                   "may differ)" if greedy else " | sampled"))
    _lookup_report(variants, reports, out)
    if hf_reference:
        report["hf_generate"] = _hf_reference(hf_reference, ref.prompt_ids, max_new_tokens, threads, ref.gen, out)
    return report


def _lookup_report(variants, reports, out) -> None:
    """Prompt lookup (no draft model) replayed on each folder's plain outputs, its speedup
    predicted from this run's decode and verify step costs (runtime.proposers)."""
    from specrt.tools.lookup_sim import predicted_lookup_speedup, simulate_lookup
    out("prompt lookup, simulated on the plain outputs (predicted x over plain: tokens per round, rounds with a "
        "verified proposal, pair rounds):")
    for v, r in zip(variants, reports):
        p, found = r["prediction"], {}
        pair, table = _pair_guessing(v.gen)
        for n in (1, 2, 3):
            stats = [simulate_lookup(ids, toks, n, v.gen.k, pair=pair, table=table)
                     for ids, toks in zip(v.prompt_ids, v.plain_out) if toks]
            rounds = sum(s.rounds for s in stats)
            found[n] = {"predicted_speedup": predicted_lookup_speedup(stats, p["t_target_1_ms"], p["t_target_k1_ms"]),
                        "tokens_per_round": sum(s.tokens for s in stats) / rounds if rounds else 0.0,
                        "proposal_share": sum(s.proposal_rounds for s in stats) / rounds if rounds else 0.0,
                        "pair_share": sum(s.pair_rounds for s in stats) / rounds if rounds else 0.0}
        r["prompt_lookup"] = found
        out(f"  {v.engines}: " + " | ".join(
            f"n={n} x{f['predicted_speedup']:.2f} ({f['tokens_per_round']:.2f}, {f['proposal_share']:.0%}"
            + (f", pairs {f['pair_share']:.0%}" if pair else "") + ")"
            for n, f in found.items()))


def _pair_guessing(gen: SpeculativeGenerator):
    """(pair rounds possible: the target's decode graph takes two tokens, the build's n-gram
    table or None) of a generator on one-row graphs."""
    from specrt.runtime.ngrams import NgramTable
    pair = gen.manifest.target.graphs["decode"].tokens >= 2 if "decode" in gen.manifest.target.graphs else False
    ngrams = (gen.manifest.proposers or {}).get("ngrams")
    return pair, NgramTable.load(gen.root / ngrams["file"]) if ngrams and pair else None


def _hf_reference(source: str, prompt_ids, max_new_tokens: int, threads: int, gen, out) -> dict:
    """Hugging Face `generate` (torch fp32, greedy) on the same prompts, interleaved with plain specrt."""
    import torch

    from specrt.export.sources import load_source

    torch.set_num_threads(threads)
    model = load_source(source).model
    t_hf = t_rt = 0.0
    n_hf = n_rt = 0
    for ids in prompt_ids:
        x = torch.tensor([ids])
        t0 = time.perf_counter()
        with torch.no_grad():
            y = model.generate(x, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False)
        t_hf += time.perf_counter() - t0
        n_hf += y.shape[1] - x.shape[1]
        t0 = time.perf_counter()
        toks = list(e.token for e in gen.tokens(ids, max_new_tokens=max_new_tokens, method="plain"))
        t_rt += time.perf_counter() - t0
        n_rt += len(toks)
    hf, rt = n_hf / t_hf, n_rt / t_rt
    out(f"Hugging Face generate {hf:.1f} tok/s | specrt plain {rt:.1f} tok/s | ratio x{rt / hf:.2f} "
        "(end to end, prefill included, same prompts and token counts)")
    return {"hf_tok_s": hf, "specrt_plain_tok_s": rt, "ratio": rt / hf}
