"""Memory, profile and quality measurements of benchmarks/batch_kernels.py (see its docstring):
process RSS of one dynamic-T session vs three static-T sessions, ONNX Runtime's per-operator
profile of batched steps, teacher-forced top-1 agreement with fp32."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from batch_measure import PREFILL, Case, new_cache, row_texts
from specrt.runtime.backends.ort_cpu import session_options


# --------------------------------------------------------------------------- 2b. sessions and RSS

def _rss_child(root: Path, name: str, graphs: list[str], threads: int) -> None:
    """In a fresh process: open `graphs` of one case, run each once at B=1, print RSS in MiB."""
    so = session_options(threads)
    case = Case(root, name, new_cache(root, name), so)
    cache_mib = sum(c.nbytes for c in case.cache) / 2 ** 20
    base = _status_mib()
    for g in graphs:
        T = case.graphs[g][1]
        for t in ([1, 5, PREFILL] if T == "dynamic" else [T]):
            case.run(1, t, 0, ids=np.ones((1, t), np.int64), lens=[100])
    now = _status_mib()
    print(json.dumps({"case": name, "graphs": graphs, "rss_mib": now["VmRSS"], "hwm_mib": now["VmHWM"],
                      "before_sessions_mib": base["VmRSS"], "kv_cache_mib": round(cache_mib),
                      "weights_bin_mib": round((root / name / "weights.bin").stat().st_size / 2 ** 20)}))


def _status_mib() -> dict:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS", "VmHWM")):
            k, v = line.split(":")
            out[k] = round(int(v.split()[0]) / 1024)
    return out


def sessions(a) -> int:
    import subprocess
    import sys
    sets = [("fp32-legacy", ["prefill", "decode", "verify"]), ("fp32-gqa-staticT", ["prefill", "decode", "verify"]),
            ("fp32-gqa", ["step"]),
            ("int4-legacy", ["prefill", "decode2", "verify"]), ("int4-gqa-staticT", ["prefill", "decode2", "verify"]),
            ("int4-gqa", ["step"])]
    for name, graphs in sets:
        if a.cases and name not in a.cases:
            continue
        code = (f"import sys; sys.path[:0] = {[str(Path(__file__).parents[1]), str(Path(__file__).parent)]!r}; "
                f"import batch_profile as m; from pathlib import Path; "
                f"m._rss_child(Path({str(a.root)!r}), {name!r}, {graphs!r}, {a.threads})")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        print(r.stdout.strip() or r.stderr[-800:])
    return 0


# --------------------------------------------------------------------------- 3. where the time goes

GROUPS = {"MatMulNBits": "MatMulNBits", "MatMulIntegerToFloat": "int8 GEMM", "DynamicQuantizeMatMul": "int8 GEMM",
          "MatMulInteger": "int8 GEMM", "GroupQueryAttention": "attention", "Attention": "attention",
          "Softmax": "attention", "TensorScatter": "attention", "MatMul": "MatMul fp32", "FusedMatMul": "MatMul fp32"}


def profile(a) -> int:
    from specrt.tools.op_profile import summarize
    names = a.cases or ["int4-gqa", "int4-standard", "int4-portable"]
    # decode of 1 and 8 rows; verify windows of 8 rows where the variant runs them
    plan = [(n, B, T) for n in names for B, T in ((1, 1), (8, 1), (8, 5)) if not (n.endswith("-gqa") and T > 1)]
    if a.tokens:      # one row of each of these T (a prompt chunk: --tokens 64)
        plan = [(n, 1, T) for n in names for T in a.tokens]
    cache = None
    for name, B, T in plan:
        so = session_options(a.threads)
        so.enable_profiling = True
        so.profile_file_prefix = f"/tmp/batch-profile-{name}-B{B}-T{T}"
        cache = cache or new_cache(a.root, name)
        case = Case(a.root, name, cache, so)
        ids, lens = np.full((B, T), 1000, np.int64), np.full(B, 512, np.int64)
        for _ in range(3 + a.rounds):
            case.run(B, T, 0, ids=ids, lens=lens)
        g = case.graph_for(B, T)
        rows = summarize({g: json.loads(Path(case.sessions[g].end_profiling()).read_text())})
        total = sum(r["ms_per_run"] for r in rows)
        groups = {}
        for r in rows:
            key = GROUPS.get(r["op_type"], "rest")
            groups[key] = groups.get(key, 0.0) + r["ms_per_run"]
        print(f"\n{name} B={B} T={T} (context 512 per row, profiler on): {total:.2f} ms operator time per run, "
              + ", ".join(f"{k} {v / total:.0%}" for k, v in sorted(groups.items(), key=lambda kv: -kv[1])))
        for r in rows[:8]:
            print(f"  {r['op_type']:<36}{r['nodes']:>5}{r['ms_per_run']:>9.3f} ms{r['share']:>7.1%}")
    return 0


# --------------------------------------------------------------------------- quality

def agreement(a) -> int:
    """Teacher-forced top-1 agreement with the first case (fp32) over every position of the 16
    rows (prompts of 24..309 tokens), each row prefilled alone in chunks of 64."""
    so = session_options(a.threads)
    rows = row_texts()
    names = a.cases or ["fp32-gqa", "int4-gqa", "int8-gqa", "int8dyn-gqa", "int8row-gqa"]
    picks = {}
    for name in names:
        case = Case(a.root, name, new_cache(a.root, name), so)
        case.all_logits = True
        got = []
        for r, ids in enumerate(rows):
            for start in range(0, len(ids), PREFILL):
                chunk = ids[start:start + PREFILL]
                out = case.run(1, PREFILL, r, ids=[chunk + [0] * (PREFILL - len(chunk))], lens=[start])
                got.append(out[0, :len(chunk)].argmax(-1))
        picks[name] = np.concatenate(got)
        del case
    base = picks[names[0]]
    for name in names[1:]:
        print(f"{name:<18} top-1 == {names[0]} at {np.mean(picks[name] == base):.3f} of {len(base)} positions")
    return 0


COMMANDS = {"sessions": sessions, "profile": profile, "agreement": agreement}
