"""specrt next to the peers a user would pick instead: onnxruntime-genai and llama.cpp, on the
same model (SmolLM2-135M-Instruct, from the same GGUF), the same token ids, greedy, 2 threads.

    make bench-peers                                     # venv, peer models, run, quality
    .venv/bin/python benchmarks/run_peers.py run [--prompts 12 --max-new-tokens 128 --systems a,b --threads 2 --json F]
    .venv/bin/python benchmarks/run_peers.py quality [--prompts 16 --new-tokens 32 --json F]
    .venv/bin/python benchmarks/run_peers.py build           # = .venv-peers/bin/python benchmarks/peers/build.py
    .venv/bin/python benchmarks/run_peers.py list            # the systems' names

run: each model is served by its own long-lived worker process (specrt's in this venv, the
peers' in .venv-peers; load time excluded); prompts are the held-out split of
specrt/calibration/data/prompts.jsonl (as `specrt quality` takes them), chat-templated by
specrt's tokenizer, and every system is given those ids. Systems run interleaved prompt by
prompt, in an order rotated each prompt, so drift on a shared machine hits all of them.
Generation stops after an EOS or max-new-tokens, for every system alike.

    decode tok/s   tokens after the first / time after the first
    e2e tok/s      tokens / time from the request to the last token
    prompt tok/s   prompt tokens / time to the first token
    = fp32         prompts whose output is token for token specrt fp32 plain's (= transformers')

quality: benchmarks/peers/quality.py (`specrt quality`'s measures, with onnxruntime-genai rows).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).with_name("peers")))
from common import PEERS_PYTHON, REFERENCE, SYSTEMS, eval_prompts, start_workers  # noqa: E402

DEFAULT_SYSTEMS = list(SYSTEMS)
TARGET = ("specrt-int4-spec", "genai-int4")    # the ratio: specrt int4 speculative / genai int4 plain


def pick_systems(names: str | None) -> list:
    wanted = [n.strip() for n in names.split(",") if n.strip()] if names else DEFAULT_SYSTEMS
    unknown = [n for n in wanted if n not in SYSTEMS]
    if unknown:
        raise SystemExit(f"unknown system(s) {unknown}: choose from {', '.join(SYSTEMS)}")
    if REFERENCE not in wanted:
        wanted.insert(0, REFERENCE)                 # exact match and the x column need it
    systems, skipped = [], []
    for n in wanted:
        why = SYSTEMS[n].missing
        if why and names:                           # asked for by name: it must run
            raise SystemExit(f"{n}: {why}")
        (skipped if why else systems).append((SYSTEMS[n], why))
    for s, why in skipped:
        print(f"skipped {s.name}: {why}")
    return [s for s, _ in systems]


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return {"cpu": cpu, "cores": os.cpu_count(), "loadavg": os.getloadavg()}


def run(a) -> dict:
    systems = pick_systems(a.systems)
    workers = start_workers(systems, a.threads)
    try:
        prompts = eval_prompts(a.prompts, a.prompt_file)
        enc = workers[SYSTEMS[REFERENCE].worker_key].ask(op="encode", texts=[p.text for p in prompts])
        ids, eos = enc["ids"], enc["eos"]
        info = {s.name: workers[s.worker_key].info for s in systems}
        start = machine()
        print(f"{len(prompts)} held-out prompts ({sum(map(len, ids))} prompt tokens), <= {a.max_new_tokens} new "
              f"tokens, greedy, {a.threads} threads | {start['cpu']}, {start['cores']} cores, load average "
              f"{start['loadavg'][0]:.1f}")
        results = {s.name: [] for s in systems}
        for i, p_ids in enumerate(ids):
            order = systems[i % len(systems):] + systems[:i % len(systems)]
            for s in order:
                r = workers[s.worker_key].ask(op="generate", ids=p_ids, n=a.max_new_tokens, eos=eos,
                                              method=s.method)
                r["prompt_tokens"] = len(p_ids)
                results[s.name].append(r)
            ref = results[REFERENCE][i]["tokens"]
            print(f"prompt {i + 1:>2}/{len(ids)} ({prompts[i].kind}, {len(p_ids)} tokens), decode tok/s "
                  "(* output differs from fp32's): " + " ".join(
                      f"{s.name} {_dec(results[s.name][i]):.0f}{'' if results[s.name][i]['tokens'] == ref else '*'}"
                      for s in systems), flush=True)
    finally:
        for w in workers.values():
            w.close()
    report = summarize(systems, results, info)
    report.update(prompts=[p.id for p in prompts], max_new_tokens=a.max_new_tokens, threads=a.threads,
                  machine_start=start, loadavg_end=os.getloadavg())
    print_table(report)
    print(f"load average (1 min) at the start {start['loadavg'][0]:.1f}, at the end {report['loadavg_end'][0]:.1f} "
          f"on {start['cores']} cores: other work on the machine slows every system, ratios hold better")
    return report


def _dec(r: dict) -> float:
    n = len(r["tokens"]) - 1
    return n / (r["t_total"] - r["t_first"]) if n > 0 else 0.0


def summarize(systems, results, info) -> dict:
    ref = results[REFERENCE]
    rows = []
    for s in systems:
        rs = results[s.name]
        n = sum(len(r["tokens"]) for r in rs)
        after_first = sum(r["t_total"] - r["t_first"] for r in rs)
        row = {"system": s.name, "label": s.label, "kind": s.kind, "path": str(s.path), "method": s.method,
               "tokens": n, "decode_tok_s": (n - len(rs)) / after_first,
               "e2e_tok_s": n / sum(r["t_total"] for r in rs),
               "prompt_tok_s": sum(r["prompt_tokens"] for r in rs) / sum(r["t_first"] for r in rs),
               "exact_match_fp32": sum(r["tokens"] == f["tokens"] for r, f in zip(rs, ref)), "prompts": len(rs),
               "versions": info[s.name], "per_prompt": rs}
        if s.method != "plain":
            row["mean_acceptance_length"] = sum(r["mean_acceptance_length"] for r in rs) / len(rs)
        rows.append(row)
    by = {r["system"]: r for r in rows}
    for row in rows:
        row["x_fp32_plain_decode"] = row["decode_tok_s"] / by[REFERENCE]["decode_tok_s"]
    report = {"reference": REFERENCE, "systems": rows}
    if all(t in by for t in TARGET):
        report["target_ratio"] = {"numerator": TARGET[0], "denominator": TARGET[1],
                                  "ratio": by[TARGET[0]]["decode_tok_s"] / by[TARGET[1]]["decode_tok_s"]}
        best = max((r for r in rows if r["system"].startswith("specrt-int4")), key=lambda r: r["decode_tok_s"])
        report["target_ratio"]["best_specrt_int4"] = {"system": best["system"],
                                                      "ratio": best["decode_tok_s"] / by[TARGET[1]]["decode_tok_s"]}
    return report


def print_table(report: dict) -> None:
    rows = report["systems"]
    w = max(len(r["label"]) for r in rows)
    head = (f"{'system':<{w}} {'decode':>7} {'e2e':>7} {'prompt':>7} {'x fp32':>7} {'= fp32':>7} "
            f"{'tokens':>7} {'accept':>6}")
    print("\n" + head + f"\n{'':<{w}} {'tok/s':>7} {'tok/s':>7} {'tok/s':>7} {'decode':>7} {'greedy':>7}"
          f" {'':>7} {'len':>6}\n" + "-" * len(head))
    for r in rows:
        acc = f"{r['mean_acceptance_length']:.2f}" if "mean_acceptance_length" in r else "-"
        print(f"{r['label']:<{w}} {r['decode_tok_s']:>7.1f} {r['e2e_tok_s']:>7.1f} {r['prompt_tok_s']:>7.0f} "
              f"{r['x_fp32_plain_decode']:>7.2f} {r['exact_match_fp32']:>3}/{r['prompts']:<3} {r['tokens']:>7} "
              f"{acc:>6}")
    versions = {k: v for r in rows for k, v in r["versions"].items() if k in ("specrt", "onnxruntime_genai",
                                                                                "llama_cpp_python")}
    print("(decode: tokens after the first / time after the first; prompt: prompt tokens / time to the first "
          "token; x fp32: decode over specrt fp32 plain's; = fp32: prompts whose output is specrt fp32 plain's, "
          "token for token; accept len: tokens per target pass) | "
          + ", ".join(f"{k} {v}" for k, v in versions.items()))
    t = report.get("target_ratio")
    if t:
        print(f"target ratio: {t['numerator']} decode / {t['denominator']} decode = x{t['ratio']:.2f} "
              f"(best specrt int4: {t['best_specrt_int4']['system']} x{t['best_specrt_int4']['ratio']:.2f})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="the speed table")
    r.add_argument("--prompts", type=int, default=12)
    r.add_argument("--max-new-tokens", type=int, default=128)
    r.add_argument("--systems", help=f"comma-separated, default all that are built: {','.join(SYSTEMS)}")
    r.add_argument("--threads", type=int, default=2)
    r.add_argument("--prompt-file", help="a .jsonl or text prompt file (default: the shipped prompts.jsonl)")
    r.add_argument("--json", help="also write the report (per-prompt ids and timings included) here")
    q = sub.add_parser("quality", help="faithfulness to fp32, specrt quality's measures, genai rows included")
    q.add_argument("--prompts", type=int, default=16, help="held-out prompts (specrt quality's --eval default)")
    q.add_argument("--new-tokens", type=int, default=32, help="greedy fp32 tokens per prompt (specrt quality's default)")
    q.add_argument("--threads", type=int, default=2)
    q.add_argument("--prompt-file")
    q.add_argument("--batched", default="",
                   help="comma-separated engine folders as extra rows, each measured on the model its requests "
                        "run, as specrt quality does (e.g. artifacts/smollm2-int8row,artifacts/smollm2-int8row-gqa)")
    q.add_argument("--json")
    sub.add_parser("build", help="build the peers' models into .cache/peers (runs in .venv-peers)")
    sub.add_parser("list", help="the systems' names")
    a, rest = ap.parse_known_args(argv)
    if a.cmd == "build":
        if not PEERS_PYTHON.exists():
            raise SystemExit(f"{PEERS_PYTHON} does not exist: run `make venv-peers`")
        return subprocess.call([str(PEERS_PYTHON), str(Path(__file__).with_name("peers") / "build.py"), *rest])
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    if a.cmd == "list":
        for s in SYSTEMS.values():
            print(f"{s.name:<20} {s.label:<40} {s.missing or 'ready'}")
        return 0
    t0 = time.perf_counter()
    if a.cmd == "run":
        report = run(a)
    else:
        from quality import quality
        report = quality(a)
    print(f"({a.cmd} took {time.perf_counter() - t0:.0f} s, worker loading included)")
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
