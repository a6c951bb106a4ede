"""`specrt profile ENGINES`: where each graph's time goes, by operator type.

Runs one generation with ONNX Runtime's profiler on (every session of the target and
the draft), then writes into OUT:

    trace.json   every session's events on one timeline (open in chrome://tracing or
                 https://ui.perfetto.dev); one process row per graph
    ops.csv      graph, op_type, nodes, calls, runs, total_ms, ms_per_run, share
and prints the table (top operators per graph). Profiling costs time on every node,
so absolute numbers are inflated; compare shares, not milliseconds, with `specrt bench`.
"""
from __future__ import annotations

import csv
import json
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Callable

from specrt.errors import ConfigError
from specrt.runtime import SpeculativeGenerator


def run_profile(engines: str, out_dir: str | Path, *, prompt: str = "Explain why the sky is blue.",
                max_new_tokens: int = 32, method: str = "speculative", threads: int = 2, top: int = 8,
                out: Callable[[str], None] = print) -> dict:
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"--out {out_dir} is a file; profile writes a folder (trace.json, ops.csv): name a new "
                          f"folder, e.g. --out {out_dir.with_suffix('')}-profile")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:    # a parent that is a file, no permission, ...
        raise ConfigError(f"--out {out_dir}: cannot create the folder ({e.strerror or e}): choose another --out") \
            from None
    with tempfile.TemporaryDirectory(prefix="specrt-profile-") as tmp:
        gen = SpeculativeGenerator(engines, threads=threads, profile_dir=tmp, methods=(method,), engine="one-row")
        done = gen.generate(prompt, chat=bool(gen.tokenizer.chat_template), max_new_tokens=max_new_tokens,
                            method=method)
        files = gen.end_profiling()
        events = {graph: json.loads(Path(f).read_text()) for graph, f in files.items()}
    table = summarize(events)
    _write_trace(events, out_dir / "trace.json")
    with open(out_dir / "ops.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["graph", "op_type", "nodes", "calls", "runs", "total_ms", "ms_per_run", "share"])
        w.writeheader()
        for row in table:
            w.writerow(row)
    out(f"profiled {len(done.tokens)} tokens ({method}); {out_dir / 'trace.json'}, {out_dir / 'ops.csv'}")
    for graph in events:
        rows = [r for r in table if r["graph"] == graph]
        if not rows:
            continue
        runs = rows[0]["runs"]
        total = sum(r["total_ms"] for r in rows)
        out(f"\n{graph}: {runs} runs, {total / max(runs, 1):.2f} ms of operator time per run")
        out(f"  {'op_type':<34} {'nodes':>5} {'ms/run':>8} {'share':>6}")
        for r in rows[:top]:
            out(f"  {r['op_type']:<34} {r['nodes']:>5} {r['ms_per_run']:>8.3f} {r['share']:>6.1%}")
    return {"files": {"trace": str(out_dir / "trace.json"), "ops": str(out_dir / "ops.csv")}, "ops": table}


def summarize(events: dict[str, list[dict]]) -> list[dict]:
    """Per graph and operator type: node count, calls, total and per-run time, share of the
    graph's operator time; sorted by graph, then time."""
    rows = []
    for graph, evs in events.items():
        runs = sum(1 for e in evs if e.get("cat") == "Session" and e.get("name") == "model_run")
        acc: dict[str, list] = defaultdict(lambda: [set(), 0, 0.0])
        for e in evs:
            if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
                continue
            a = acc[e.get("args", {}).get("op_name", "?")]
            a[0].add(e["name"])
            a[1] += 1
            a[2] += e.get("dur", 0) / 1000.0
        total = sum(v[2] for v in acc.values()) or 1.0
        for op, (names, calls, ms) in sorted(acc.items(), key=lambda kv: -kv[1][2]):
            rows.append({"graph": graph, "op_type": op, "nodes": len(names), "calls": calls, "runs": runs,
                         "total_ms": round(ms, 3), "ms_per_run": round(ms / max(runs, 1), 4),
                         "share": round(ms / total, 4)})
    return rows


def _write_trace(events: dict[str, list[dict]], path: Path) -> None:
    """One Chrome trace: each graph's events on its own process row, named."""
    merged = []
    for pid, (graph, evs) in enumerate(events.items(), start=1):
        merged.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": graph}})
        for e in evs:
            merged.append({**e, "pid": pid})
    path.write_text(json.dumps(merged))
