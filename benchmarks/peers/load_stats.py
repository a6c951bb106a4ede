"""The measures of `benchmarks/concurrency.py` from its per-request records, the tables, and the
issue's ratios (issue 15: at 8 clients specrt int4 >= 1.5x onnxruntime-genai int4 static batches
and >= OpenVINO GenAI; at 1 client specrt's server no slower than its single stream)."""
from __future__ import annotations

import numpy as np

# (name, numerator, denominator, clients)
RATIOS = (("specrt int4 / genai int4 static batches", "specrt-int4", "genai-int4", 8),
          ("specrt int4 / OpenVINO int4 continuous batching", "specrt-int4", "openvino-int4", 8),
          ("specrt int4 / llama-server Q4_1", "specrt-int4", "llama-q4_1", 8),
          ("specrt fp32 / genai fp32 static batches", "specrt-fp32", "genai-fp32", 8),
          ("specrt int4 server / its single stream", "specrt-int4", "specrt-int4-stream", 1),
          ("specrt fp32 server / its single stream", "specrt-fp32", "specrt-fp32-stream", 1),
          ("specrt int4 alt / specrt int4", "specrt-int4-alt", "specrt-int4", 8),
          ("specrt int4 alt / genai int4 static batches", "specrt-int4-alt", "genai-int4", 8),
          ("specrt int4 alt / OpenVINO int4", "specrt-int4-alt", "openvino-int4", 8),
          ("specrt int4 alt / its single stream", "specrt-int4-alt", "specrt-int4-stream", 1),
          ("specrt int4 alt / specrt int4 int4-prefill alt", "specrt-int4-alt", "specrt-int4same-alt", 8),
          ("specrt int4 int4-prefill alt / genai int4 static batches", "specrt-int4same-alt", "genai-int4", 8),
          ("specrt int4 int4-prefill alt / OpenVINO int4", "specrt-int4same-alt", "openvino-int4", 8),
          ("specrt int4 gqa alt / genai int4 static batches", "specrt-int4gqa-alt", "genai-int4", 8),
          ("specrt int4 gqa alt / OpenVINO int4", "specrt-int4gqa-alt", "openvino-int4", 8),
          ("specrt int4 gqa alt / specrt int4 alt", "specrt-int4gqa-alt", "specrt-int4-alt", 8),
          ("specrt int4 gqa alt / its single stream", "specrt-int4gqa-alt", "specrt-int4-stream", 1),
          ("specrt int4 gqa alt / specrt int4 alt (1 client)", "specrt-int4gqa-alt", "specrt-int4-alt", 1),
          ("specrt int4 alt / specrt int4 server, one request per engine", "specrt-int4-alt", "specrt-int4", 1),
          ("specrt int4 in process / genai int4 static batches", "specrt-int4-inproc", "genai-int4", 8),
          ("specrt int4 in process / OpenVINO int4", "specrt-int4-inproc", "openvino-int4", 8),
          ("specrt int4 in process / specrt int4 alt (the server)", "specrt-int4-inproc", "specrt-int4-alt", 8),
          ("specrt int4 in process / its single stream", "specrt-int4-inproc", "specrt-int4-stream", 1),
          ("specrt int4 block 128 in process / genai int4 static batches", "specrt-int4b128-inproc", "genai-int4", 8),
          ("specrt int4 block 128 in process / OpenVINO int4", "specrt-int4b128-inproc", "openvino-int4", 8),
          *((f"specrt int4 batched block {b} alt / {what}", f"specrt-int4b{b}-alt", den, c)
            for b in (64, 128)
            for what, den, c in (("genai int4 static batches", "genai-int4", 8), ("OpenVINO int4", "openvino-int4", 8),
                                 ("specrt int4 alt", "specrt-int4-alt", 8), ("its single stream", "specrt-int4-stream", 1),
                                 ("specrt int4 alt (1 client)", "specrt-int4-alt", 1))))


def _pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) * 1000 if xs else None


def level_stats(recs: list[dict], alone: list) -> dict:
    """recs: one record per request (runners.py); alone[i]: the system's answer to request i's
    prompt served alone."""
    t_start = min(r["t_submit"] for r in recs)
    t_end = max(r["t_chunks"][-1] for r in recs if r["t_chunks"])
    tokens = sum(r["n_tokens"] for r in recs)
    ttft = [r["t_chunks"][0] - r["t_submit"] for r in recs if r["t_chunks"]]
    gaps = [b - a for r in recs for a, b in zip(r["t_chunks"], r["t_chunks"][1:])]
    tpot = [(r["t_chunks"][-1] - r["t_chunks"][0]) / (r["n_tokens"] - 1) for r in recs
            if r["n_tokens"] > 1 and len(r["t_chunks"]) > 1]
    return {"requests": len(recs), "tokens": tokens, "wall_s": t_end - t_start, "agg_tok_s": tokens / (t_end - t_start),
            "ttft_p50_ms": _pct(ttft, 50), "ttft_p99_ms": _pct(ttft, 99), "itl_p50_ms": _pct(gaps, 50),
            "itl_p99_ms": _pct(gaps, 99), "tpot_p50_ms": _pct(tpot, 50), "tpot_p99_ms": _pct(tpot, 99),
            "equal_alone": sum(r["answer"] == want for r, want in zip(recs, alone)),
            "differs_from_alone": [r["index"] for r, want in zip(recs, alone) if r["answer"] != want]}


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}" if x >= 100 else f"{x:.1f}"


def print_level(clients: int, rows: list[dict], order: list[str]) -> None:
    rows = sorted(rows, key=lambda r: order.index(r["system"]))
    w = max(len(r["label"]) for r in rows)
    head = (f"{'system':<{w}} {'agg':>7} {'TTFT':>7} {'TTFT':>7} {'ITL':>6} {'ITL':>6} {'TPOT':>6} {'TPOT':>6} "
            f"{'= alone':>8} {'tokens':>6} {'wall':>6} {'load':>5}")
    print(f"\n{clients} client{'s' if clients > 1 else ''}\n{head}\n{'':<{w}} {'tok/s':>7} {'p50 ms':>7} "
          f"{'p99 ms':>7} {'p50':>6} {'p99':>6} {'p50':>6} {'p99':>6} {'':>8} {'':>6} {'s':>6} {'avg':>5}\n"
          + "-" * len(head))
    for r in rows:
        print(f"{r['label']:<{w}} {r['agg_tok_s']:>7.1f} {_ms(r['ttft_p50_ms']):>7} {_ms(r['ttft_p99_ms']):>7} "
              f"{_ms(r['itl_p50_ms']):>6} {_ms(r['itl_p99_ms']):>6} {_ms(r['tpot_p50_ms']):>6} "
              f"{_ms(r['tpot_p99_ms']):>6} {r['equal_alone']:>3}/{r['requests']:<4} {r['tokens']:>6} "
              f"{r['wall_s']:>6.1f} {r['loadavg']:>5.1f}")
    for r in rows:
        if r.get("step_costs"):
            print(f"  {r['system']} ms per step by rows in the step: " + ", ".join(
                f"{k}: {v['mean_ms']:.1f} ({v['steps']})" for k, v in r["step_costs"].items()))
        if r.get("rss_mib"):
            print(f"  {r['system']} server RSS {r['rss_mib']:.0f} MiB after the level")
    print(flush=True)


def round_ratios(num: dict, den: dict) -> list[float]:
    """num's aggregate tok/s over den's, round by round (--rounds R: in round i both ran within a
    minute of each other, so a slow minute of the shared machine weighs on both); [] with one
    round, or when the two did not run the same rounds."""
    a, b = num.get("rounds_agg_tok_s") or [], den.get("rounds_agg_tok_s") or []
    if len(a) < 2 or len(a) != len(b):
        return []
    return [x / y for x, y in zip(a, b)]


def print_summary(report: dict) -> dict:
    res = report["results"]
    out = {}
    print("summary: aggregate tok/s ratios in this run (issue 15 targets: x1.5 over genai int4 and >= x1.0 over "
          "OpenVINO at 8 clients; >= x1.0 over the single stream at 1 client)")
    for name, num, den, clients in RATIOS:
        level = res.get(str(clients), {})
        if num in level and den in level:
            ratio = level[num]["agg_tok_s"] / level[den]["agg_tok_s"]
            out[name] = {"clients": clients, "numerator": num, "denominator": den, "ratio": ratio}
            per_round = round_ratios(level[num], level[den])
            if per_round:
                out[name]["round_ratios"] = per_round
                out[name]["median_round_ratio"] = float(np.median(per_round))
            print(f"  {clients} client{'s' if clients > 1 else ''}: {name}: {level[num]['agg_tok_s']:.1f} / "
                  f"{level[den]['agg_tok_s']:.1f} = x{ratio:.2f}"
                  + (f"; round by round x{np.median(per_round):.2f} ({', '.join(f'x{r:.2f}' for r in per_round)})"
                     if per_round else ""))
    # every specrt system against every peer in the run: the median rounds' ratio, and the best
    # rounds' (these VMs have slow spells of minutes, x1.4 for whatever runs in them:
    # docs/benchmarks.md, 2026-12-07 session 35; a system's best round is its speed outside one)
    for clients in report["levels"]:
        level = res.get(str(clients), {})
        ours = [n for n in level if n.startswith("specrt")]
        peers = [n for n in level if not n.startswith("specrt")]
        for num in ours:
            for den in peers:
                med = level[num]["agg_tok_s"] / level[den]["agg_tok_s"]
                best = max(level[num]["rounds_agg_tok_s"]) / max(level[den]["rounds_agg_tok_s"])
                out.setdefault("pairs", []).append({"clients": clients, "numerator": num, "denominator": den,
                                                    "median_ratio": med, "best_round_ratio": best})
                print(f"  {clients} client{'s' if clients > 1 else ''}: {num} / {den}: x{med:.2f} (median rounds), "
                      f"x{best:.2f} (best rounds)")
    print("batch invariance (requests equal to the same system's answer alone), by clients:")
    names = list(report["systems"])
    for s in names:
        cells = [f"{c}: {res[str(c)][s]['equal_alone']}/{res[str(c)][s]['requests']}" for c in report["levels"]
                 if s in res.get(str(c), {})]
        print(f"  {s:<20} " + "  ".join(cells))
    print(f"load average at the start {report['loadavg_start'][0]:.1f}, at the end {report['loadavg_end'][0]:.1f} "
          "(1 min): other work on the machine slows every system; same-run ratios hold better than absolute figures")
    return out
