"""The batched KV cache: np.zeros (numpy backs arrays of 4 MiB and more with transparent huge pages)
against runtime/kv.py lazy_zeros, two engines over one folder in one process, calls interleaved:
each new row's first prefill (time, RSS growth) and warm 24-row steps at 150 and 600 positions.

    .venv/bin/python benchmarks/kv_memory.py artifacts/smollm2-int8row
"""
import sys, time, statistics, numpy as np
import specrt.runtime.backends.batch_kv as ob
from specrt.runtime.batch.generator import open_batch
def rss():
    for l in open('/proc/self/status'):
        if l.startswith('VmRSS'): return int(l.split()[1]) // 1024
folder = sys.argv[1]
orig = ob.lazy_zeros
ob.lazy_zeros = lambda shape, dtype=np.float32: np.zeros(shape, dtype)
a = open_batch(folder, max_num_seqs=24)          # np.zeros caches
ob.lazy_zeros = orig
b = open_batch(folder, max_num_seqs=24)          # lazy caches
ta, tb = a.engine.target, b.engine.target
def call(t, T, row, start, graph, n=1):
    toks = np.ones((n, T), np.int64); starts = np.full(n, start, np.int64)
    pos = np.full((n, 1), T - 1, np.int64) if graph == "prefill" else None
    t0 = time.perf_counter(); t.step(graph, toks, starts, row, pos, pad_start=0); return (time.perf_counter() - t0) * 1e3
first = {"np.zeros": [], "lazy": []}; grow = {"np.zeros": 0, "lazy": 0}
for r in range(24):                               # each row's first prefill, alternating engines
    for name, t in (("np.zeros", ta), ("lazy", tb)) if r % 2 else (("lazy", tb), ("np.zeros", ta)):
        r0 = rss(); first[name].append(call(t, 40, r, 0, "prefill")); grow[name] += rss() - r0
for name in first:
    print(f"{name:9s} 24 new rows' first 40-token prefill: median {statistics.median(first[name]):.1f} ms; RSS +{grow[name]} MB")
for ctx in (150, 600):
    for t in (ta, tb):
        for r in range(24): call(t, 64, r, ctx - 64, "prefill")
    st = {"np.zeros": [], "lazy": []}
    for i in range(16):
        for name, t in (("np.zeros", ta), ("lazy", tb)) if i % 2 else (("lazy", tb), ("np.zeros", ta)):
            st[name].append(call(t, 1, 0, ctx, "step", 24))
    z, l = statistics.median(st["np.zeros"][2:]), statistics.median(st["lazy"][2:])
    print(f"24x1 step at {ctx} positions: np.zeros {z:.2f} ms, lazy {l:.2f} ms, lazy/np.zeros x{l / z:.2f}")
