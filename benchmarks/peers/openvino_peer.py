"""OpenVINO GenAI as a worker kind (worker.py openvino MODEL_DIR THREADS, in .venv-openvino):
its `ContinuousBatchingPipeline` (what `LLMPipeline` runs when given a `SchedulerConfig`), fed
token ids, greedy, prefix caching off, its CPU plugin's defaults otherwise.

serve(requests, clients): continuous batching as a server with `clients` clients sees it: at
most `clients` requests in flight (`SchedulerConfig.max_num_seqs` = clients), a new one added
as soon as one finishes. The loop calls `step()` itself and reads each request's handle after
every step, so each token gets its own arrival time (TTFT and inter-token latency per request),
and each step's duration is kept with the number of requests in flight (cost per step and
batch size). The model folder is `optimum-cli export openvino` output (build.py openvino).
"""
from __future__ import annotations

import time
from pathlib import Path

# the compiled model's properties worth reading back: where the CPU plugin's speed comes from
PROPERTIES = ("PERFORMANCE_HINT", "INFERENCE_PRECISION_HINT", "KV_CACHE_PRECISION", "KEY_CACHE_PRECISION",
              "VALUE_CACHE_PRECISION", "KEY_CACHE_GROUP_SIZE", "VALUE_CACHE_GROUP_SIZE",
              "DYNAMIC_QUANTIZATION_GROUP_SIZE", "EXECUTION_MODE_HINT", "INFERENCE_NUM_THREADS", "NUM_STREAMS",
              "ENABLE_HYPER_THREADING", "ENABLE_CPU_PINNING", "SCHEDULING_CORE_TYPE")


class OpenVINO:
    methods = ("plain",)

    def __init__(self, path: str, threads: int):
        import numpy as np
        import openvino as ov
        import openvino_genai as ov_genai
        self.np, self.ov, self.ov_genai = np, ov, ov_genai
        self.path, self.threads = path, threads
        self.pipe, self.clients = None, None
        self.configure(1)
        self.info = {"openvino": ov.__version__, "openvino_genai": ov_genai.__version__,
                     "properties": self.properties()}

    def properties(self) -> dict:
        """The CPU plugin's settings in effect, read back from the exported model compiled with the
        same plugin config (the pipeline's own compiled model is not exposed)."""
        core = self.ov.Core()
        cm = core.compile_model(str(Path(self.path) / "openvino_model.xml"), "CPU", self._plugin_config())
        out = {}
        for name in PROPERTIES:
            try:
                out[name] = str(cm.get_property(name))
            except Exception as e:                 # a property this version does not have
                out[name] = f"n/a ({type(e).__name__})"
        return out

    def _plugin_config(self) -> dict:
        return {"INFERENCE_NUM_THREADS": self.threads}

    def configure(self, clients: int) -> None:
        """A pipeline whose scheduler runs at most `clients` sequences (rebuilt when that changes:
        load time, not measured)."""
        if clients == self.clients:
            return
        sc = self.ov_genai.SchedulerConfig()
        sc.max_num_seqs = clients
        sc.enable_prefix_caching = False           # the same request twice must not reuse a prefix
        self.pipe = None
        self.pipe = self.ov_genai.ContinuousBatchingPipeline(self.path, sc, "CPU", self._plugin_config())
        self.clients = clients

    def _config(self, n: int, eos: set):
        gc = self.ov_genai.GenerationConfig()
        gc.max_new_tokens = n
        gc.do_sample = False
        gc.stop_token_ids = set(eos)
        gc.ignore_eos = not eos                     # no EOS ids: --ignore-eos, every request runs n tokens
        return gc

    def serve(self, requests, clients, n, eos):
        self.configure(clients)
        gc = self._config(n, eos)
        pending = list(enumerate(requests))
        live, recs, steps = {}, {}, []
        t0 = time.perf_counter()
        while pending or live:
            while pending and len(live) < clients:
                i, ids = pending.pop(0)
                live[i] = self.pipe.add_request(i, self.ov.Tensor(self.np.asarray([ids], dtype=self.np.int64)), gc)
                recs[i] = {"index": i, "t_submit": time.perf_counter() - t0, "tokens": [], "t_tokens": []}
            t_step = time.perf_counter()
            self.pipe.step()
            now = time.perf_counter()
            steps.append((len(live), now - t_step))
            for i, h in list(live.items()):
                while h.can_read():
                    for out in h.read().values():          # the tokens since the last read
                        recs[i]["tokens"].extend(int(t) for t in out.generated_ids)
                        recs[i]["t_tokens"].extend([now - t0] * len(out.generated_ids))
                if h.get_status() != self.ov_genai.GenerationStatus.RUNNING:
                    del live[i]
        return {"records": [recs[i] for i in sorted(recs)], "steps": steps}

    def generate(self, ids, n, eos, method="plain"):
        r = self.serve([ids], 1, n, eos)["records"][0]
        return {"tokens": r["tokens"], "t_first": r["t_tokens"][0] if r["t_tokens"] else None,
                "t_total": r["t_tokens"][-1] if r["t_tokens"] else 0.0}
