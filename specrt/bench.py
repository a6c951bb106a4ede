"""`specrt bench`: plain vs speculative decoding on the same prompts, interleaved in one
run (the machines are shared and noisy: only ratios measured side by side mean
anything). Prints tokens/s of each, their ratio, acceptance, and whether the outputs
were token-for-token identical."""
from __future__ import annotations

import time
from typing import Callable

from specrt.prompts import PROMPTS
from specrt.runtime import SamplingParams, SpeculativeGenerator


def _run(gen: SpeculativeGenerator, ids: list[int], n: int, sampling, method: str):
    eos = gen.tokenizer.eos_token_ids
    toks = []
    for e in gen.tokens(ids, max_new_tokens=n, sampling=sampling, method=method):
        toks.append(e.token)
        if e.token in eos:
            break
    m = gen.last_metrics
    return toks, m.time_total - m.time_prefill, m


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


def memory_report(gen: SpeculativeGenerator) -> dict:
    weights = sum(m.entry.weights["bytes"] for m in (gen.target, gen.draft) if m is not None)
    kv = gen.target.cache.nbytes + (gen.draft.cache.nbytes if gen.draft and gen.draft.cache is not gen.target.cache else 0)
    rss = rss_bytes()
    return {"rss_bytes": rss, "weight_bytes": weights, "kv_bytes": kv, "rss_over_weights": rss / weights,
            "sessions": sum(len(m.graphs) for m in (gen.target, gen.draft) if m is not None)}


def run_bench(engines: str, *, prompts: int = 8, max_new_tokens: int = 128, rounds: int = 1, k: int | None = None,
              threads: int = 2, sampling: SamplingParams | None = None, hf_reference: str | None = None,
              memory: str = "fast", out: Callable[[str], None] = print) -> dict:
    sampling = sampling or SamplingParams()
    gen = SpeculativeGenerator(engines, k=k, threads=threads, memory=memory)
    texts = (PROMPTS * (1 + prompts // len(PROMPTS)))[:prompts]
    prompt_ids = [gen.encode_prompt(p, chat=bool(gen.tokenizer.chat_template)) for p in texts]
    _run(gen, prompt_ids[0], 8, sampling, "plain")           # warm-up: first-run allocations
    _run(gen, prompt_ids[0], 8, sampling, "speculative")
    mem = memory_report(gen)
    out(f"memory ({memory}): RSS {mem['rss_bytes'] / 2**20:.0f} MiB with {mem['sessions']} sessions loaded and run | "
        f"weights on disk {mem['weight_bytes'] / 2**20:.0f} MiB (x{mem['rss_over_weights']:.2f}) | "
        f"KV cache {mem['kv_bytes'] / 2**20:.0f} MiB")
    rows, t_plain, t_spec, n_plain, n_spec = [], 0.0, 0.0, 0, 0
    accepted = drafted = iters = 0
    identical_all = True
    out(f"{'prompt':>6} {'plain tok/s':>12} {'spec tok/s':>11} {'ratio':>6} {'accept':>7} {'len':>5} identical")
    for r in range(rounds):
        for i, ids in enumerate(prompt_ids):
            order = ("plain", "speculative") if (i + r) % 2 == 0 else ("speculative", "plain")
            res = {m: _run(gen, ids, max_new_tokens, sampling, m) for m in order}
            (tp, dp, _), (ts, ds, ms) = res["plain"], res["speculative"]
            same = tp == ts
            identical_all &= same
            t_plain += dp
            t_spec += ds
            n_plain += len(tp)
            n_spec += len(ts)
            accepted, drafted, iters = accepted + ms.accepted, drafted + ms.drafted, iters + ms.iterations
            row = {"prompt": i, "plain_tok_s": len(tp) / dp, "spec_tok_s": len(ts) / ds, "identical": same,
                   "acceptance_rate": ms.acceptance_rate, "mean_acceptance_length": ms.mean_acceptance_length,
                   "tokens": len(ts)}
            rows.append(row)
            out(f"{i:>6} {row['plain_tok_s']:>12.1f} {row['spec_tok_s']:>11.1f} "
                f"{row['spec_tok_s'] / row['plain_tok_s']:>6.2f} {ms.acceptance_rate:>7.1%} "
                f"{ms.mean_acceptance_length:>5.2f} {'yes' if same else 'NO'}")
    plain_tps, spec_tps = n_plain / t_plain, n_spec / t_spec
    report = {
        "engines": str(engines), "k": gen.k, "greedy": sampling.greedy, "max_new_tokens": max_new_tokens,
        "prompts": prompts, "rounds": rounds, "plain_tok_s": plain_tps, "spec_tok_s": spec_tps,
        "speedup": spec_tps / plain_tps, "acceptance_rate": accepted / drafted if drafted else 0.0,
        "mean_acceptance_length": 1 + accepted / iters if iters else 0.0,
        "identical": identical_all, "rows": rows, "memory": mem,
    }
    out(f"\nplain {plain_tps:.1f} tok/s | speculative {spec_tps:.1f} tok/s | speedup x{report['speedup']:.2f} | "
        f"acceptance {report['acceptance_rate']:.1%} | mean acceptance length {report['mean_acceptance_length']:.2f} | "
        + (f"outputs identical: {'yes' if identical_all else 'NO'}" if sampling.greedy else "sampled (outputs differ by design)"))
    if hf_reference:
        report["hf_generate"] = _hf_reference(hf_reference, prompt_ids, max_new_tokens, threads, gen, out)
    return report


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
