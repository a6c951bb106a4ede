"""Triton Inference Server Python-backend model over `SpeculativeGenerator`.

`specrt triton-repo` copies this file to `<repo>/<model>/1/model.py`. The model is
decoupled: every accepted text chunk is its own response, and the last response of a
request carries `finish_reason` and the FINAL flag.

    inputs   text_input [1] BYTES; optional max_tokens [1] INT32, temperature [1] FP32,
             top_p [1] FP32, seed [1] INT64, stop [-1] BYTES, chat [1] BOOL
    outputs  text_output [1] BYTES, finish_reason [1] BYTES ("" until the last response)

Triton runs every model instance in its own stub process, and calls one instance's
`execute` one batch at a time, so each instance's generator serves one request at a
time (`instance_group.count` = concurrent generations). Only `specrt.runtime` is
imported (numpy, onnxruntime, tokenizers, jinja2): no FastAPI, torch or transformers.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

try:
    import triton_python_backend_utils as pb_utils
except ImportError:         # outside Triton; tests inject a stand-in module
    pb_utils = None

FINISH = {"eos": "stop", "stop": "stop", "length": "length", "max_context": "length"}


def _scalar(request, name: str, default):
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return default
    v = t.as_numpy().reshape(-1)
    if v.size == 0:
        return default
    return v[0].item() if isinstance(v[0], np.generic) else v[0]


def _text(v) -> str:
    return v.decode("utf-8") if isinstance(v, bytes) else str(v)


def _response(text: str, finish: str = ""):
    return pb_utils.InferenceResponse(output_tensors=[
        pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_)),
        pb_utils.Tensor("finish_reason", np.array([finish.encode("utf-8")], dtype=np.object_))])


class TritonPythonModel:
    def initialize(self, args):
        from specrt import manifest as mf
        from specrt.runtime import SpeculativeGenerator
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        engines = Path(params["engines"])
        if not engines.is_absolute():       # copied into the model folder (--copy-engines)
            engines = Path(args["model_repository"]) / engines
        self.method = "speculative" if mf.load(engines).draft is not None else "plain"
        self.gen = SpeculativeGenerator(engines, memory=params.get("memory", "fast"), methods=(self.method,))

    def execute(self, requests):
        for request in requests:
            self._serve(request)
        return None     # decoupled: every answer goes through a response sender

    def _serve(self, request):
        from specrt.errors import SpecrtError
        from specrt.runtime import SamplingParams
        sender = request.get_response_sender()
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        stream = None
        try:
            prompt = _text(_scalar(request, "text_input", b""))
            stop_t = pb_utils.get_input_tensor_by_name(request, "stop")
            stop = [_text(s) for s in stop_t.as_numpy().reshape(-1)] if stop_t is not None else []
            seed = _scalar(request, "seed", None)
            sampling = SamplingParams(temperature=float(_scalar(request, "temperature", 0.0)),
                                      top_p=float(_scalar(request, "top_p", 1.0)),
                                      seed=None if seed is None else int(seed))
            stream = self.gen.stream(prompt, max_new_tokens=int(_scalar(request, "max_tokens", 128)),
                                     sampling=sampling, stop=stop, chat=bool(_scalar(request, "chat", False)),
                                     method=self.method)
            for chunk in stream:        # arguments are checked at the first step
                if request.is_cancelled():
                    code = getattr(pb_utils.TritonError, "CANCELLED", None)
                    err = pb_utils.TritonError("cancelled by the client", *(() if code is None else (code,)))
                    sender.send(pb_utils.InferenceResponse(error=err), flags=final)
                    return
                if chunk.text:
                    sender.send(_response(chunk.text))
            finish = FINISH.get(self.gen.last_metrics.finish_reason, "stop")
        except (SpecrtError, ValueError, UnicodeDecodeError) as e:
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(f"{type(e).__name__}: {e}")),
                        flags=final)
            return
        finally:
            if stream is not None:
                stream.close()  # rewinds the caches whatever happened
        sender.send(_response("", finish), flags=final)

    def finalize(self):
        self.gen = None
