"""Fused vs unfused graphs (and onnxruntime-genai's model) step by step, in bare ONNX Runtime
sessions: prefill T=64, decode T=1 and verify T=k+1, interleaved in one process.

    # fused fp32 and int4 copies of an unfused export (reads SRC, writes OUT)
    .venv/bin/python benchmarks/fusion.py prepare --src artifacts/smollm2/target --out /tmp/fusion
    # time them (ratios to the first case); --peer adds onnxruntime-genai's model.onnx
    .venv/bin/python benchmarks/fusion.py run artifacts/smollm2/target /tmp/fusion/fp32-fused \\
        /tmp/fusion/int4 /tmp/fusion/int4-fused [--peer .cache/peers/genai-fp32] [--rounds 20]
    # per-operator time of the same cases (ONNX Runtime's profiler)
    .venv/bin/python benchmarks/fusion.py profile /tmp/fusion/fp32 --peer .cache/peers/genai-fp32

Every case runs the same way: one process-wide pool of --threads threads (the runtime's
session options), inputs and outputs bound once, the KV cache bound as both past and
present (in place, as the runtime and onnxruntime-genai's shared buffer do). Each round
runs every case's graphs once, in an order rotated per round, so the shared machine's
drift hits every case alike: read the ratios, not the milliseconds.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from specrt.runtime.backends.ort_cpu import session_options  # noqa: E402

GRAPHS = ("prefill", "decode", "verify")


class Case:
    """One model's graphs bound to one KV cache of M rows. run(graph) = one step at `past`."""

    def __init__(self, label: str, sessions: dict, feeds: dict, tokens: dict):
        self.label, self.sessions, self.tokens = label, sessions, tokens
        self.feeds = feeds          # the bound buffers: ORT holds raw pointers into them
        self.bindings = {}
        for g, s in sessions.items():
            b = s.io_binding()
            for name, arr in feeds[g]["in"].items():
                b.bind_cpu_input(name, arr)
            for name, arr in feeds[g]["out"].items():
                b.bind_output(name, "cpu", 0, arr.dtype, arr.shape, arr.ctypes.data)
            self.bindings[g] = b

    def run(self, graph: str) -> float:
        t0 = CLOCK[0]()
        self.sessions[graph].run_with_iobinding(self.bindings[graph])
        return CLOCK[0]() - t0


# "wall": perf_counter. "cpu": the process's CPU time over the run (all its threads), which
# does not advance while other tenants hold the cores: on a loaded machine it tracks the
# work a graph does far better than wall time (it misses only waits on memory and spinning)
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
CLOCK = [time.perf_counter]


def _np(t: str):
    return {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
            "tensor(int32)": np.int32}[t]


def _session(path: Path, so, tag: str) -> ort.InferenceSession:
    if so.enable_profiling:     # one trace per session; ORT's file names only differ by the second
        so.profile_file_prefix = str(Path(PROFILE_DIR[0]) / tag)
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


PROFILE_DIR = [tempfile.gettempdir()]


def specrt_case(directory: Path, so, past: int, M: int) -> Case:
    """An export directory (prefill/decode/verify.onnx + weights.bin, manifest optional)."""
    sessions = {g: _session(directory / f"{g}.onnx", so, f"{directory.name}-{g}")
                for g in GRAPHS if (directory / f"{g}.onnx").exists()}
    first = next(iter(sessions.values()))
    kv = {i.name: np.zeros([d if isinstance(d, int) else M for d in i.shape], _np(i.type))
          for i in first.get_inputs() if i.name.startswith("past_")}
    feeds, tokens = {}, {}
    for g, s in sessions.items():
        T = s.get_inputs()[0].shape[1]
        tokens[g] = T
        ins = {"input_ids": np.zeros((1, T), np.int64), "past_len": np.array([0 if g == "prefill" else past], np.int64),
               **kv}
        outs = {}
        for o in s.get_outputs():
            if o.name.startswith("present_"):            # in place: the cache buffer itself
                outs[o.name] = kv[o.name.replace("present_", "past_")]
            else:
                outs[o.name] = np.zeros(o.shape, _np(o.type))
        feeds[g] = {"in": ins, "out": outs}
    return Case(directory.name, sessions, feeds, tokens)


def genai_case(directory: Path, so, past: int, M: int, tokens: dict) -> Case:
    """onnxruntime-genai's model.onnx (dynamic shapes), one session per graph (as ours, so each
    has its own profile), fed as our graphs' T; past_key_values.* and present.* share a buffer."""
    sessions = {g: _session(directory / "model.onnx", so, f"genai-{g}") for g in tokens}
    s = next(iter(sessions.values()))
    past_in = [i for i in s.get_inputs() if i.name.startswith("past_key_values")]
    kv = {i.name: np.zeros((1, i.shape[1], M, 64), _np(i.type)) for i in past_in}
    vocab = s.get_outputs()[0].shape[-1]
    feeds = {}
    for g, T in tokens.items():
        start = 0 if g == "prefill" else past
        ins = {"input_ids": np.zeros((1, T), np.int64), "attention_mask": np.ones((1, start + T), np.int64), **kv}
        outs = {"logits": np.zeros((1, T, vocab), np.float32),
                **{n.replace("past_key_values", "present"): a for n, a in kv.items()}}
        feeds[g] = {"in": ins, "out": outs}
    return Case(f"genai:{directory.name}", sessions, feeds, tokens)


def load_cases(dirs: list[str], peer: str | None, threads: int, past: int, profile: str | None = None) -> list[Case]:
    so = session_options(threads)
    if profile:
        so.enable_profiling = True
        PROFILE_DIR[0] = profile
    cases = []
    for d in dirs:
        cases.append(specrt_case(Path(d), so, past, _capacity(Path(d))))
    if peer:
        cases.append(genai_case(Path(peer), so, past, _capacity(Path(dirs[0])), cases[0].tokens))
    return cases


def _capacity(directory: Path) -> int:
    m = onnx.load(str(directory / "decode.onnx"), load_external_data=False)
    past = next(i for i in m.graph.input if i.name.startswith("past_k"))
    return past.type.tensor_type.shape.dim[2].dim_value


def interleave(cases: list[Case], rounds: int, warmup: int = 3) -> dict:
    """{label: {graph: [seconds per run]}}: each round runs every case's graphs once, the
    cases in an order rotated per round."""
    times = {c.label: {g: [] for g in c.sessions} for c in cases}
    for r in range(warmup + rounds):
        order = cases[r % len(cases):] + cases[:r % len(cases)]
        for c in order:
            for g in c.sessions:
                dt = c.run(g)
                if r >= warmup:
                    times[c.label][g].append(dt)
    return times


def report(cases: list[Case], times: dict) -> list[dict]:
    """Per case and graph: median and fastest run (on a loaded machine the fastest run is the
    least disturbed one), and the speedup over the first case on each."""
    base = cases[0]
    rows = []
    for c in cases:
        row = {"case": c.label}
        for g in GRAPHS:
            if g not in times[c.label]:
                continue
            med, best = statistics.median(times[c.label][g]) * 1e3, min(times[c.label][g]) * 1e3
            ref_med, ref_best = statistics.median(times[base.label][g]) * 1e3, min(times[base.label][g]) * 1e3
            row[g] = {"median_ms": round(med, 2), "min_ms": round(best, 2),
                      "x_median": round(ref_med / med, 3), "x_min": round(ref_best / best, 3)}
            if g == "prefill":
                row[g]["tok_s_min"] = round(c.tokens[g] / best * 1e3, 1)
        rows.append(row)
    print(f"{'case':<20}" + "".join(f"{g + ' ms med/min':>22}{'x med/min':>14}" for g in GRAPHS))
    for row in rows:
        line = f"{row['case']:<20}"
        for g in GRAPHS:
            r = row.get(g)
            line += f"{r['median_ms']:>13.2f}/{r['min_ms']:<8.2f}{r['x_median']:>7.3f}/{r['x_min']:<6.3f}" if r else " " * 36
        print(line)
    print(f"(x = {base.label}'s ms / this case's ms, per graph, on the median and on the fastest run)")
    return rows


def profile_table(cases: list[Case], runs: int, top: int) -> None:
    """Per graph: operator time per run of each case (profiler on: compare shares and
    differences, not absolute milliseconds)."""
    from specrt.tools.op_profile import summarize
    interleave(cases, runs, warmup=0)
    for g in GRAPHS:
        for c in cases:
            if g not in c.sessions:
                continue
            rows = summarize({g: json.loads(Path(c.sessions[g].end_profiling()).read_text())})
            per_run = sum(r["ms_per_run"] for r in rows)
            print(f"\n{c.label} {g} (T={c.tokens[g]}): {per_run:.2f} ms operator time per run, "
                  f"{sum(r['nodes'] for r in rows)} nodes")
            for r in rows[:top]:
                print(f"  {r['op_type']:<40}{r['nodes']:>5}{r['ms_per_run']:>9.3f} ms{r['share']:>7.1%}")


def prepare(src: Path, out: Path) -> None:
    """OUT/fp32-fused (fuse.fuse_model on each of SRC's graphs, as the export now does), and
    SRC's and the fused graphs quantized to int4 as the build does (OUT/int4, OUT/int4-fused:
    calibration.quantize with config.PRECISIONS["int4"])."""
    from specrt.calibration import quantize
    from specrt.builder.config import PRECISIONS
    from specrt.export import fuse
    from specrt.export import weights as wpack
    out.mkdir(parents=True, exist_ok=True)
    protos, tokens = {}, {}
    for g in GRAPHS:
        model = onnx.load(str(src / f"{g}.onnx"))
        tokens[g] = model.graph.input[0].type.tensor_type.shape.dim[1].dim_value
        protos[g] = fuse.fuse_model(model)
        print(g, json.dumps(fuse.describe(protos[g])))
    wpack.save_graphs(protos, out / "fp32-fused", tokens)
    spec = quantize.QuantSpec(**PRECISIONS["int4"])
    export = {"dims": {"vocab": protos["decode"].graph.output[0].type.tensor_type.shape.dim[2].dim_value},
              "graphs": {g: {"file": f"{g}.onnx", "tokens": tokens[g]} for g in GRAPHS}}
    for name, d in (("int4", src), ("int4-fused", out / "fp32-fused")):
        quantize.quantize_graphs(d, export, out / name, GRAPHS, spec)
        print(out / name, "written")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    pp = sub.add_parser("prepare")
    pp.add_argument("--src", required=True)
    pp.add_argument("--out", required=True)
    for name in ("run", "profile"):
        r = sub.add_parser(name)
        r.add_argument("dirs", nargs="+", help="export directories (prefill/decode/verify.onnx + weights.bin)")
        r.add_argument("--peer", help="an onnxruntime-genai model directory (model.onnx)")
        r.add_argument("--threads", type=int, default=2)
        r.add_argument("--past", type=int, default=100, help="cache length for decode/verify steps")
        r.add_argument("--rounds", type=int, default=20)
        r.add_argument("--top", type=int, default=10)
        r.add_argument("--clock", choices=tuple(CLOCKS), default="wall")
        r.add_argument("--json")
    a = p.parse_args()
    if a.cmd == "prepare":
        prepare(Path(a.src), Path(a.out))
        return
    CLOCK[0] = CLOCKS[a.clock]
    if a.cmd == "run":
        cases = load_cases(a.dirs, a.peer, a.threads, a.past)
        rows = report(cases, interleave(cases, a.rounds))
        if a.json:
            Path(a.json).write_text(json.dumps({"clock": a.clock, "past": a.past, "threads": a.threads, "rounds": a.rounds,
                                                "cases": rows}, indent=1))
        return
    with tempfile.TemporaryDirectory(prefix="fusion-profile-") as tmp:
        cases = load_cases(a.dirs, a.peer, a.threads, a.past, profile=tmp)
        profile_table(cases, a.rounds, a.top)


if __name__ == "__main__":
    main()
