"""One long-lived worker per system: it loads one model, warms it up, then answers JSON
requests a line at a time on stdin (one JSON reply a line on stdout).

    python worker.py specrt ENGINE_DIR THREADS     (specrt's venv; methods plain/speculative/lookup)
    python worker.py genai  MODEL_DIR  THREADS     (.venv-peers; onnxruntime-genai)
    python worker.py llama  FILE.gguf  THREADS     (.venv-peers; llama-cpp-python)
    python worker.py openvino MODEL_DIR THREADS    (.venv-openvino; OpenVINO GenAI, openvino_peer.py)

requests
    {"op": "generate", "ids": [...], "n": 128, "eos": [...], "method": "plain"}
        -> {"tokens": [...], "t_first": s, "t_total": s}   greedy; stops after an EOS or n tokens;
           t_first = time to the first token (prefill and the first choice), t_total = all of it
           (specrt also: "t_tokens", the time of each token)
    {"op": "batch", "requests": [[ids], ...], "batch": B, "n": 128, "eos": [...]}   (genai only)
        -> {"records": [{"index", "t_submit", "tokens", "t_tokens"}, ...], "steps": [[rows, s], ...]}
           static batches of B in order (benchmarks/concurrency.py)
    {"op": "serve", "requests": [[ids], ...], "clients": N, "n": 128, "eos": [...]}   (openvino only)
        -> the same, continuous batching with N requests in flight (openvino_peer.py)
    {"op": "encode", "texts": [...]}   (specrt only) -> {"ids": [[...], ...], "eos": [...]}
    {"op": "logits", "ids": [...], "tokens": [...], "out": "rows.npy"}   (genai only)
        -> {"rows": [len(tokens), V]}   teacher-forced: the prompt, then one token at a time,
           row i = the logits that choose tokens[i] (as specrt quality's teacher forcing)
Every system is given token ids, never text: all of them see the same prompt.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path


class Specrt:
    def __init__(self, path: str, threads: int):
        import specrt
        from specrt.runtime import SpeculativeGenerator
        self.gen = SpeculativeGenerator(path, threads=threads)
        self.info = {"specrt": specrt.__version__, "precision": self.gen.manifest.target.precision,
                     "k": self.gen.k, "draft": self.gen.draft is not None}
        self.methods = self.gen.methods

    def encode(self, texts):
        """The chat-templated ids of each text, and the EOS ids: what every system is given."""
        return {"ids": [self.gen.encode_prompt(t, chat=True) for t in texts],
                "eos": sorted(self.gen.tokenizer.eos_token_ids)}

    def generate(self, ids, n, eos, method="plain"):
        toks, times = [], []
        t0 = time.perf_counter()
        stream = self.gen.tokens(ids, max_new_tokens=n, method=method)
        try:
            for e in stream:
                times.append(time.perf_counter() - t0)
                toks.append(e.token)
                if e.token in eos:
                    break
        finally:
            stream.close()
        t_total = time.perf_counter() - t0
        m = self.gen.last_metrics
        return {"tokens": toks, "t_first": times[0] if times else None, "t_total": t_total, "t_tokens": times,
                "mean_acceptance_length": m.mean_acceptance_length if method != "plain" else None}


class SpecrtBatch:
    """specrt's batched engine in process (`open_batch`, the Python API a service embeds): the
    like-for-like counterpart of genai's and OpenVINO's in-process runs, with no server or HTTP
    client sharing the cores. serve() keeps at most `clients` requests in flight, as a client pool."""
    methods = ("plain",)

    def __init__(self, path: str, threads: int):
        import specrt
        self.path, self.threads, self.gen, self.rows = path, threads, None, None
        self.info = {"specrt": specrt.__version__}

    def serve(self, requests, clients, n, eos):
        import queue

        from specrt.runtime.batch.generator import open_batch
        from specrt.runtime.batch.request import Delta, Done, Failed
        if self.rows != clients:                    # (re)opened per level: load time, not measured
            if self.gen is not None:
                self.gen.close()
            # the prefill budget of the server runs (`--prefill-budget 1024`, docs/benchmarks.md)
            self.gen = open_batch(self.path, max_num_seqs=clients, threads=self.threads, prefill_budget=1024)
            self.rows = clients
        done: queue.Queue = queue.Queue()
        recs = {}
        t0 = time.perf_counter()

        def sink_for(i):
            def sink(ev):                           # on the engine thread
                now = time.perf_counter() - t0
                if isinstance(ev, Delta):
                    recs[i]["tokens"].extend(ev.tokens)
                    recs[i]["t_tokens"].extend([now] * len(ev.tokens))
                elif isinstance(ev, (Done, Failed)):
                    if isinstance(ev, Done) and ev.finish_reason in ("eos", "stop"):
                        recs[i]["tokens"].append(-1)        # the EOS it generated, as the others count it
                        recs[i]["t_tokens"].append(now)
                    done.put(ev)
            return sink

        pending, live = list(enumerate(requests)), 0
        while pending or live:
            while pending and live < clients:
                i, ids = pending.pop(0)
                recs[i] = {"index": i, "t_submit": time.perf_counter() - t0, "tokens": [], "t_tokens": []}
                self.gen.submit(list(ids), max_new_tokens=n, ignore_eos=not eos, sink=sink_for(i))
                live += 1
            ev = done.get()
            if isinstance(ev, Failed):
                raise RuntimeError(f"a request failed: {ev}")
            live -= 1
        return {"records": [recs[i] for i in sorted(recs)], "steps": []}

    def generate(self, ids, n, eos, method="plain"):
        r = self.serve([ids], 1, n, eos)["records"][0]
        return {"tokens": r["tokens"], "t_first": r["t_tokens"][0] if r["t_tokens"] else None,
                "t_total": r["t_tokens"][-1] if r["t_tokens"] else 0.0}


class Genai:
    methods = ("plain",)

    def __init__(self, path: str, threads: int):
        import onnxruntime_genai as og
        self.og = og
        config = og.Config(path)
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {"intra_op_num_threads": threads}}}}))
        self.model = og.Model(config)
        self.pad = json.loads((Path(path) / "genai_config.json").read_text())["model"]["pad_token_id"]
        self.info = {"onnxruntime_genai": og.__version__, "pad_token_id": self.pad}

    def _generator(self, length: int, ignore_eos: bool = False):
        params = self.og.GeneratorParams(self.model)
        # no EOS ids (--ignore-eos): min_length keeps genai from ending a sequence at its EOS
        params.set_search_options(do_sample=False, max_length=length, **({"min_length": length} if ignore_eos else {}))
        return self.og.Generator(self.model, params)

    def generate(self, ids, n, eos, method="plain"):
        toks, t_first = [], None
        t0 = time.perf_counter()                 # the Generator (its KV buffers) is per request: timed
        g = self._generator(len(ids) + n, ignore_eos=not eos)
        g.append_tokens(ids)                     # the prompt's forward pass
        while not g.is_done() and len(toks) < n:
            g.generate_next_token()              # the previous token's forward pass, then the choice
            toks.append(int(g.get_next_tokens()[0]))
            if t_first is None:
                t_first = time.perf_counter() - t0
            if toks[-1] in eos:
                break
        return {"tokens": toks, "t_first": t_first, "t_total": time.perf_counter() - t0}

    def batch(self, requests, batch, n, eos):
        """Static batches, what onnxruntime-genai's users do: the requests in order, `batch` at a
        time, each batch a Generator over [B, T] ids right-padded with pad_token_id (as
        Tokenizer.encode_batch pads); a batch ends when its longest member ends, then the next
        one starts. Times from the start of the call; steps = (rows, seconds) per forward pass."""
        import numpy as np
        recs, steps = [], []
        t0 = time.perf_counter()
        for start in range(0, len(requests), batch):
            rows = requests[start:start + batch]
            width = max(map(len, rows))
            ids = np.full((len(rows), width), self.pad, dtype=np.int32)   # [B, T]
            for r, p in enumerate(rows):
                ids[r, :len(p)] = p
            t_submit = time.perf_counter() - t0
            params = self.og.GeneratorParams(self.model)
            params.set_search_options(do_sample=False, max_length=width + n, batch_size=len(rows),
                                      **({} if eos else {"min_length": width + n}))    # (--ignore-eos)
            g = self.og.Generator(self.model, params)
            g.append_tokens(ids)                  # the prompts' forward pass
            out = [{"index": start + r, "t_submit": t_submit, "tokens": [], "t_tokens": []} for r in range(len(rows))]
            live = set(range(len(rows)))
            while live and not g.is_done():
                t_step = time.perf_counter()
                g.generate_next_token()
                nxt = g.get_next_tokens()         # [B]
                now = time.perf_counter()
                steps.append((len(rows), now - t_step))
                for r in sorted(live):
                    out[r]["tokens"].append(int(nxt[r]))
                    out[r]["t_tokens"].append(now - t0)
                    if int(nxt[r]) in eos or len(out[r]["tokens"]) >= n:
                        live.discard(r)
            recs.extend(out)
        return {"records": recs, "steps": steps}

    def logits(self, ids, tokens, out):
        import numpy as np
        g = self._generator(len(ids) + len(tokens) + 1)
        g.append_tokens(ids)
        rows = [np.array(g.get_logits(), dtype=np.float32).reshape(-1)]
        for t in tokens[:-1]:
            g.append_tokens([t])
            rows.append(np.array(g.get_logits(), dtype=np.float32).reshape(-1))
        np.save(out, np.stack(rows))
        return {"rows": [len(rows), int(rows[0].shape[0])]}


class Llama:
    methods = ("plain",)

    def __init__(self, path: str, threads: int):
        import llama_cpp
        self.llm = llama_cpp.Llama(model_path=path, n_ctx=1024, n_batch=512, n_threads=threads,
                                   n_threads_batch=threads, verbose=False)
        self.info = {"llama_cpp_python": llama_cpp.__version__}

    def generate(self, ids, n, eos, method="plain"):
        toks, t_first = [], None
        self.llm.reset()                         # no prefix reuse from the previous request
        t0 = time.perf_counter()
        stream = self.llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True)
        for t in stream:                         # temp 0: llama.cpp's greedy sampler
            if t_first is None:
                t_first = time.perf_counter() - t0
            toks.append(int(t))
            if t in eos or len(toks) >= n:
                break
        stream.close()
        return {"tokens": toks, "t_first": t_first, "t_total": time.perf_counter() - t0}


def _openvino(path: str, threads: int):
    from openvino_peer import OpenVINO          # .venv-openvino only
    return OpenVINO(path, threads)


KINDS = {"specrt": Specrt, "specrt-batch": SpecrtBatch, "genai": Genai, "llama": Llama, "openvino": _openvino}


def main() -> int:
    kind, path, threads = sys.argv[1], sys.argv[2], int(sys.argv[3])
    real_stdout = sys.stdout
    sys.stdout = sys.stderr                      # libraries' prints must not corrupt the protocol
    t0 = time.perf_counter()
    system = KINDS[kind](path, threads)
    warm = list(range(100, 196))                # 96 tokens: the batched prompt paths too
    for method in system.methods:                # first-run allocations, outside the timing
        system.generate(warm, 8, set(), method)
    system.info["load_s"] = time.perf_counter() - t0
    print(json.dumps({"ready": system.info}), file=real_stdout, flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        try:
            if req["op"] == "generate":
                reply = system.generate(req["ids"], req["n"], set(req["eos"]), req.get("method", "plain"))
            elif req["op"] == "encode":
                reply = system.encode(req["texts"])
            elif req["op"] == "logits":
                reply = system.logits(req["ids"], req["tokens"], req["out"])
            elif req["op"] == "batch":
                reply = system.batch(req["requests"], req["batch"], req["n"], set(req["eos"]))
            elif req["op"] == "serve":
                reply = system.serve(req["requests"], req["clients"], req["n"], set(req["eos"]))
            else:
                reply = {"error": f"unknown op {req['op']!r}"}
        except Exception as e:                   # reported to the orchestrator, which stops
            reply = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(reply), file=real_stdout, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
