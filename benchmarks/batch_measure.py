"""The measurements of benchmarks/batch_kernels.py (see its docstring for the commands).

A Case is one export folder (export.json + graphs + weights.bin) whose graphs run over ONE
shared KV cache of SLOTS rows per layer ([SLOTS, KVH, M, D]); an n-row call binds the first
n slots (a contiguous view), a one-row call binds slot r alone, so a row's cache is the same
memory whichever call reads it.
"""
from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from specrt.runtime.backends.ort_cpu import session_options

SLOTS = 16
BATCHES = (1, 2, 4, 8, 16)
WINDOWS = (1, 2, 5)             # decode, pair round, verify k+1=5
PREFILL = 64
CONTEXTS = (128, 512)
NP = {"tensor(float)": np.float32, "tensor(int64)": np.int64, "tensor(int32)": np.int32}


class Case:
    """One export folder. graph_for(B, T) picks the graph that runs B rows of T tokens (None:
    this case cannot: a one-row graph, another static bucket, or GroupQueryAttention's CPU
    limit, B > 1 with T > 1 over a non-empty cache). Sessions open on first use."""

    def __init__(self, root: Path, name: str, cache: list[np.ndarray], so: ort.SessionOptions):
        self.dir, self.name, self.cache, self.so = root / name, name, cache, so
        meta = json.loads((self.dir / "export.json").read_text())
        self.batch, self.attention = meta.get("batch"), meta["attention"]
        self.graphs = {g: (e["file"], e["tokens"]) for g, e in meta["graphs"].items()}
        self.sessions: dict[str, ort.InferenceSession] = {}
        self.bindings: dict[tuple, tuple] = {}
        self._hold: list[np.ndarray] = []   # logit_pos arrays bound by pointer: kept alive here
        self.all_logits = False     # True: every position's logits (agreement, invariance), not the engine's pick

    def graph_for(self, B: int, T: int) -> str | None:
        if (self.batch is None and B != 1) or (isinstance(self.batch, int) and B != self.batch):
            return None
        if self.attention == "gqa" and B > 1 and T > 1:
            return None
        static = [g for g, (_, t) in self.graphs.items() if t == T]
        return static[0] if static else next((g for g, (_, t) in self.graphs.items() if t == "dynamic"), None)

    def session(self, g: str) -> ort.InferenceSession:
        if g not in self.sessions:
            self.sessions[g] = ort.InferenceSession(str(self.dir / self.graphs[g][0]), self.so,
                                                    providers=["CPUExecutionProvider"])
        return self.sessions[g]

    def bind(self, B: int, T: int, first: int = 0):
        """(binding, ids [B, T], past_len [B], logits [B, T, V], returned K/V) over slots first..first+B."""
        key = (B, T, first)
        if key not in self.bindings:
            s = self.session(self.graph_for(B, T))
            ids, lens = np.zeros((B, T), np.int64), np.zeros(B, np.int64)
            vocab = s.get_outputs()[0].shape[-1]
            # graphs with logit_pos return only the positions asked for, as the engine asks: every
            # position of a decode step or verify window, the last one of a prompt chunk
            P = T if T <= 8 or self.all_logits or not any(i.name == "logit_pos" for i in s.get_inputs()) else 1
            logits = _shared(("logits", B, P, vocab), (B, P, vocab))
            b = s.io_binding()
            b.bind_cpu_input("input_ids", ids)
            b.bind_cpu_input("past_len", lens)
            if any(i.name == "logit_pos" for i in s.get_inputs()):
                pos = np.ascontiguousarray(np.broadcast_to(np.arange(T - P, T, dtype=np.int64), (B, P)))
                self._hold.append(pos)
                b.bind_cpu_input("logit_pos", pos)
            b.bind_output("logits", "cpu", 0, np.float32, logits.shape, logits.ctypes.data)
            returned = []
            for i, c in enumerate(self.cache):
                kv = "kv"[i % 2]
                view = c[first:first + B]
                b.bind_cpu_input(f"past_{kv}_{i // 2}", view)
                if self.attention == "portable":     # new K/V returned, written by the caller (KVCache.write)
                    new = _shared(("new", i, B, T), (B, c.shape[1], T, c.shape[3]))
                    b.bind_output(f"new_{kv}_{i // 2}", "cpu", 0, np.float32, new.shape, new.ctypes.data)
                    returned.append((view, new))
                else:                                # in place: present is the cache itself
                    b.bind_output(f"present_{kv}_{i // 2}", "cpu", 0, np.float32, view.shape, view.ctypes.data)
            self.bindings[key] = (b, ids, lens, logits, returned)
        return self.bindings[key]

    def run(self, B: int, T: int, first: int = 0, ids=None, lens=None) -> np.ndarray:
        """One step; returns the logits buffer [B, T, V] (reused by the next run of this shape)."""
        b, ids_buf, lens_buf, logits, returned = self.bind(B, T, first)
        if ids is not None:
            ids_buf[...] = ids
        if lens is not None:
            lens_buf[...] = lens
        self.session(self.graph_for(B, T)).run_with_iobinding(b)
        same = bool((lens_buf == lens_buf[0]).all())
        for view, new in returned:           # the caller's write of the returned K/V (runtime: KVCache.write)
            if same:
                view[:, :, lens_buf[0]:lens_buf[0] + T] = new
            else:
                for r in range(B):
                    view[r, :, lens_buf[r]:lens_buf[r] + T] = new[r]
        return logits


_BUFFERS: dict[tuple, np.ndarray] = {}


def _shared(key: tuple, shape: tuple) -> np.ndarray:
    """One output buffer per shape for every case of the process (runs are sequential; read a
    result before the next run of the same shape)."""
    if key not in _BUFFERS:
        _BUFFERS[key] = np.zeros(shape, np.float32)
    return _BUFFERS[key]


def new_cache(root: Path, name: str) -> list[np.ndarray]:
    meta = json.loads((root / name / "export.json").read_text())
    d = meta["dims"]
    M = MAX_M
    return [np.zeros((SLOTS, int(d["kv_heads"]), M, int(d["head_dim"])), np.float32) for _ in range(2 * int(d["layers"]))]


MAX_M = 1024 + PREFILL      # the exports' kv capacity (batch_kernels: max_context 1024 + the widest window)


def row_texts(n: int = SLOTS) -> list[list[int]]:
    """n token rows from the calibration prompts (chat template), of lengths 24, 43, .. 309:
    row r = prompts 7r, 7r+1, .. joined, cut to its length."""
    from tokenizers import Tokenizer
    from batch_kernels import PROMPTS, ROOT
    tok = Tokenizer.from_file(str(ROOT / "artifacts/smollm2/tokenizer.json"))
    prompts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines() if line.strip()]
    rows = []
    for r in range(n):
        want, ids, i = 24 + 19 * r, [], 7 * r
        while len(ids) < want:
            text = f"<|im_start|>user\n{prompts[i % len(prompts)]}<|im_end|>\n<|im_start|>assistant\n"
            ids += tok.encode(text).ids
            i += 1
        rows.append(ids[:want])
    return rows


def prefill_rows(case: Case, rows: list[list[int]], upto: list[int]) -> None:
    """Write rows[r][:upto[r]] into slot r's cache, one row at a time, in padded chunks."""
    for r, ids in enumerate(rows):
        for start in range(0, upto[r], PREFILL):
            chunk = ids[start:min(start + PREFILL, upto[r])]
            case.run(1, PREFILL, r, ids=[chunk + [0] * (PREFILL - len(chunk))], lens=[start])


def _fmt_cmp(a: np.ndarray, b: np.ndarray) -> tuple[bool, float]:
    return bool(np.array_equal(a, b)), float(np.abs(a - b).max())


# --------------------------------------------------------------------------- 1. batch invariance

def invariance_case(case: Case, rows: list[list[int]]) -> dict:
    """Per T: row r of an n-row call vs row r alone (same graph, same T), n = 1..16; the other
    rows' contents and lengths changed under a fixed row; the first window position across T."""
    lens = np.array([len(ids) - max(WINDOWS) for ids in rows], np.int64)      # the window = the last 5 tokens
    prefill_rows(case, rows, list(lens))
    win = np.array([ids[-max(WINDOWS):] for ids in rows], np.int64)          # [SLOTS, 5]
    out = {"case": case.name, "by_T": {}, "cross_T": {}}
    alone = {}
    for T in WINDOWS:
        if case.graph_for(1, T) is None:
            continue
        alone[T] = np.stack([case.run(1, T, r, ids=win[r:r + 1, :T], lens=lens[r:r + 1])[0].copy()
                             for r in range(SLOTS)])                          # [SLOTS, T, V]
        res = {}
        for n in range(1, SLOTS + 1):
            if case.graph_for(n, T) is None:
                res[n] = None
                continue
            got = case.run(n, T, 0, ids=win[:n, :T], lens=lens[:n])
            eq = [np.array_equal(got[r], alone[T][r]) for r in range(n)]
            res[n] = {"rows_equal": int(sum(eq)), "rows": n,
                      "max_abs": float(np.abs(got[:n] - alone[T][:n]).max())}
        out["by_T"][T] = res
        # row 0 fixed, the other 7 rows given other tokens and longer contexts (their writes land
        # past their windows, so no row's prefilled context changes)
        n = 8
        if case.graph_for(n, T) is not None:
            ids = win[:n, :T].copy()
            ids[1:] = (ids[1:] * 7 + 11) % 49152
            other = lens[:n].copy()
            other[1:] += np.arange(1, n) * 3 + max(WINDOWS)
            got = case.run(n, T, 0, ids=ids, lens=other)
            out["by_T"][T]["others_changed"] = bool(np.array_equal(got[0], alone[T][0]))
    # the same positions computed in windows of other sizes (B=1): decode vs pair vs verify rows;
    # the longest window is the reference, compared on the positions both windows hold
    ref = max(alone, default=None)
    for T in alone:
        if T != ref:
            eq = np.array_equal(alone[T], alone[ref][:, :T])
            out["cross_T"][T] = {"vs_T": ref, "equal": bool(eq),
                                 "max_abs": float(np.abs(alone[T] - alone[ref][:, :T]).max())}
    return out


def _inv_line(res: dict) -> str:
    cells = []
    for n, r in res.items():
        if not isinstance(n, int):
            continue
        cells.append("  -  " if r is None else ("  =  " if r["rows_equal"] == r["rows"] else
                                                 f"{r['rows_equal']:>2}/{r['rows']:<2}"))
    return " ".join(cells)


def invariance(a) -> int:
    so = session_options(a.threads)
    rows = row_texts()
    names = a.cases or ["fp32-legacy", "fp32-gqa", "fp32-standard", "fp32-portable", "int4-legacy", "int4-gqa",
                        "int4-standard", "int4-portable", "int8-gqa", "int8dyn-gqa"]
    results = []
    print("row r of an n-row call == row r alone (same graph, same T), bit for bit: '=' all rows, "
          "'k/n' k rows equal, '-' the graph cannot run n rows of T")
    print(f"{'case':<16}{'T':>3}  " + " ".join(f"n={n:<3}" for n in range(1, SLOTS + 1)) + "  others changed")
    for name in names:
        cache = new_cache(a.root, name)
        case = Case(a.root, name, cache, so)
        case.all_logits = True
        r = invariance_case(case, rows)
        results.append(r)
        for T, res in r["by_T"].items():
            worst = max((x["max_abs"] for n, x in res.items() if isinstance(n, int) and x), default=0.0)
            print(f"{name:<16}{T:>3}  {_inv_line(res)}  {res.get('others_changed', '-')!s:<6} max|d| {worst:.3g}")
        for T, c in r["cross_T"].items():
            print(f"{'':<16}    the first {T} positions of a T={T} call vs of a T={c['vs_T']} call (B=1, 16 rows): "
                  f"{'equal' if c['equal'] else 'DIFFER'}, max|d| {c['max_abs']:.3g}")
        del case, cache
    _cross_case(a, so, rows)
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))
    return 0


def _cross_case(a, so, rows) -> None:
    """The batched graphs at B=1 vs today's one-row graphs (fp32-legacy / int4-legacy), on the same
    prefilled rows: bit for bit? (prefill chunks, decode, verify)."""
    for legacy, batched in (("fp32-legacy", "fp32-gqa"), ("int4-legacy", "int4-gqa"),
                            ("fp32-legacy", "fp32-gqa-staticT")):
        if not all((a.root / n).exists() for n in (legacy, batched)):
            continue
        cases = [Case(a.root, n, new_cache(a.root, n), so) for n in (legacy, batched)]
        for c in cases:
            c.all_logits = True
        lens = [len(ids) - max(WINDOWS) for ids in rows[:4]]
        for c in cases:
            prefill_rows(c, rows[:4], lens)
        same_cache = all(np.array_equal(x, y) for x, y in zip(cases[0].cache, cases[1].cache))
        line = [f"{batched} B=1 vs {legacy}: prefilled caches {'equal' if same_cache else 'DIFFER'}"]
        for T in (1, 2, 5, PREFILL):
            outs = []
            for c in cases:
                ids = [(rows[0] * 3)[:T]]
                outs.append(c.run(1, T, 0, ids=ids, lens=[lens[0]]).copy())
            eq, d = _fmt_cmp(*outs)
            line.append(f"T={T} {'equal' if eq else f'max|d| {d:.3g}'}")
        print("; ".join(line))


# --------------------------------------------------------------------------- 2. cost per step

def _configs(cases: list[Case], batches, tokens, contexts):
    return [(c, ctx, B, T) for c in cases for ctx in contexts for B in batches for T in tokens
            if c.graph_for(B, T) is not None]


def time_configs(configs, rounds: int, warmup: int = 1) -> dict:
    """{(case, ctx, B, T): (wall seconds, cpu seconds) per run}: each round runs every config
    once, in an order rotated per round, so the machine's drift hits every config alike."""
    times = {(c.name, ctx, B, T): ([], []) for c, ctx, B, T in configs}
    for r in range(warmup + rounds):
        k = (r * 7) % len(configs)
        for c, ctx, B, T in configs[k:] + configs[:k]:
            ids = np.full((B, T), 1000, np.int64)
            lens = np.full(B, ctx, np.int64)
            w0, c0 = time.perf_counter(), time.process_time()
            c.run(B, T, 0, ids=ids, lens=lens)
            w1, c1 = time.perf_counter(), time.process_time()
            if r >= warmup:
                times[(c.name, ctx, B, T)][0].append(w1 - w0)
                times[(c.name, ctx, B, T)][1].append(c1 - c0)
    return times


def cost(a) -> int:
    so = session_options(a.threads)
    names = a.cases or ["fp32-gqa", "fp32-standard", "fp32-portable"]
    cache = new_cache(a.root, names[0])
    cases = [Case(a.root, n, cache, so) for n in names]
    configs = _configs(cases, a.batches or BATCHES, a.tokens or (*WINDOWS, PREFILL), a.contexts or CONTEXTS)
    print(f"{len(configs)} configurations x {a.rounds} rounds, interleaved; threads={a.threads}")
    times = time_configs(configs, a.rounds)
    med = {k: (statistics.median(w) * 1e3, statistics.median(c) * 1e3) for k, (w, c) in times.items()}
    for ctx in a.contexts or CONTEXTS:
        print(f"\n== context {ctx} tokens per row: median ms per step (wall) | tokens/s = B*T / step")
        print(f"{'case':<18}{'T':>4}" + "".join(f"{'B=' + str(B):>18}" for B in BATCHES))
        for c in cases:
            for T in a.tokens or (*WINDOWS, PREFILL):
                cells = [med.get((c.name, ctx, B, T)) for B in BATCHES]
                if not any(cells):
                    continue
                print(f"{c.name:<18}{T:>4}" + "".join(
                    f"{x[0]:>8.1f} ({B * T / x[0] * 1e3:>6.0f})" if x else f"{'-':>18}" for x, B in zip(cells, BATCHES)))
    base = cases[0].name
    print(f"\nratio to {base} (median wall ms of the same configuration, same run):")
    for (name, ctx, B, T), (w, _) in sorted(med.items()):
        ref = med.get((base, ctx, B, T))
        if name != base and ref:
            print(f"  {name:<18} ctx={ctx:<4} B={B:<3} T={T:<3} x{w / ref[0]:.3f}  (cpu-time x{med[(name, ctx, B, T)][1] / ref[1]:.3f})")
    if a.json:
        a.json.write_text(json.dumps([{"case": k[0], "ctx": k[1], "B": k[2], "T": k[3], "wall_ms": v[0], "cpu_ms": v[1],
                                       "runs_wall_ms": [x * 1e3 for x in times[k][0]]} for k, v in med.items()], indent=1))
    return 0


COMMANDS = {"invariance": invariance, "cost": cost}
