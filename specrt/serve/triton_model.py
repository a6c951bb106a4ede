"""Triton Inference Server Python-backend model over specrt's runtime.

`specrt triton-repo` copies this file to `<repo>/<model>/1/model.py`. The model is
decoupled: every accepted text chunk is its own response, and the last response of a
request carries `finish_reason` and the FINAL flag (or is an error response, FINAL).

    inputs   text_input [1] BYTES; optional max_tokens [1] INT32, temperature [1] FP32,
             top_p [1] FP32, seed [1] INT64, stop [-1] BYTES, chat [1] BOOL
    outputs  text_output [1] BYTES, finish_reason [1] BYTES ("" until the last response)

Each instance runs one `BatchGenerator` (`open_batch`: the engine every other caller runs,
so the answers are `specrt generate`'s and the server's) with the config's `max_num_seqs` rows
(default 1; more need engines built with `specrt build --batch`): `execute` submits and returns
at once, and the engine thread streams every request through its response sender. Up to
`max_num_seqs` requests decode at once and `queue_size` more wait for a row (then an
UNAVAILABLE error); each more instance (`instance_group.count`) is another copy of the weights.

Only `specrt.runtime` is imported (numpy, onnxruntime, tokenizers, jinja2): no FastAPI,
torch or transformers.
"""
from __future__ import annotations

import json
import logging
import threading
from pathlib import Path

import numpy as np

try:
    import triton_python_backend_utils as pb_utils
except ImportError:         # outside Triton; tests inject a stand-in module
    pb_utils = None

FINISH = {"eos": "stop", "stop": "stop", "length": "length", "max_context": "length"}
DEFAULT_QUEUE = 8       # requests that may wait for a row when the config gives no queue_size
log = logging.getLogger("specrt.triton")


def _scalar(request, name: str, default):
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return default
    v = t.as_numpy().reshape(-1)
    if v.size == 0:
        return default
    if isinstance(v[0], np.floating) and v.dtype.itemsize < 8:
        # an FP32 input holds the client's 0.8 as 0.800000011920929: take the shortest decimal that
        # is the same FP32 number, so a seeded sample is the one the other APIs give for 0.8
        return float(np.format_float_positional(v[0], unique=True))
    return v[0].item() if isinstance(v[0], np.generic) else v[0]


def _text(v) -> str:
    return v.decode("utf-8") if isinstance(v, bytes) else str(v)


def _inputs(request) -> tuple[str, dict]:
    """The request's prompt and the generator keywords both paths share (raises on bad input)."""
    from specrt.runtime import SamplingParams
    prompt = _text(_scalar(request, "text_input", b""))
    stop_t = pb_utils.get_input_tensor_by_name(request, "stop")
    seed = _scalar(request, "seed", None)
    sampling = SamplingParams(temperature=float(_scalar(request, "temperature", 0.0)),
                              top_p=float(_scalar(request, "top_p", 1.0)), seed=None if seed is None else int(seed))
    kw = {"max_new_tokens": int(_scalar(request, "max_tokens", 128)), "sampling": sampling,
          "stop": [_text(s) for s in stop_t.as_numpy().reshape(-1)] if stop_t is not None else [],
          "chat": bool(_scalar(request, "chat", False))}
    structured = _scalar(request, "structured", None)
    if structured is not None:      # JSON text naming one structured output (runtime/grammar.py)
        kw["structured"] = json.loads(_text(structured))
    return prompt, kw


def _response(text: str, finish: str = ""):
    return pb_utils.InferenceResponse(output_tensors=[
        pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_)),
        pb_utils.Tensor("finish_reason", np.array([finish.encode("utf-8")], dtype=np.object_))])


def _error(message: str, code: str | None = None):
    """An error response; `code` names a TritonError code when this Triton has it."""
    c = getattr(pb_utils.TritonError, code, None) if code else None
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, *(() if c is None else (c,))))


def _bad_input(e: Exception):
    return _error(f"{type(e).__name__}: {e}", "INVALID_ARG")


def _bad_input_types():
    from specrt.errors import SpecrtError
    return SpecrtError, ValueError, UnicodeDecodeError


class _Answer:
    """One request on the batched engine. `sink` runs on the engine thread: each Delta's text
    is a response, Done the FINAL one; exactly one FINAL, whatever ends the request (done,
    failed, cancelled by the client, the model unloaded). It never raises: an exception out of
    a sink would fail the engine step and so every other running request. `on_final()` runs
    once, when the request is answered for good."""

    def __init__(self, request, on_final):
        self.request, self.sender, self.on_final = request, request.get_response_sender(), on_final
        self.handle = None              # set once submit returns; the sink may run before that
        self.final = False
        self._lock = threading.Lock()

    def sink(self, ev) -> None:
        from specrt.runtime.batch.request import Delta, Done, Failed
        try:
            if self.final:
                return
            if isinstance(ev, Delta):
                if self.request.is_cancelled():
                    self.finish(_error("cancelled by the client", "CANCELLED"))
                elif ev.text:
                    self.sender.send(_response(ev.text))
            elif isinstance(ev, Done):
                if ev.finish_reason in ("cancelled", "timeout"):
                    # the client (seen by the engine's poll, waiting or running), or finalize()
                    self.finish(_error("cancelled by the client", "CANCELLED") if self.request.is_cancelled()
                                else _error("cancelled: the model is being unloaded; retry", "CANCELLED"))
                else:
                    self.finish(_response("", FINISH.get(ev.finish_reason, "stop")))
            elif isinstance(ev, Failed):
                log.error("batched generation failed: %s", ev.error)
                self.finish(_error(f"generation failed ({type(ev.error).__name__}: {ev.error})", "INTERNAL"))
        except Exception:
            log.exception("sending a response failed: the request is dropped")
            self._end()

    def finish(self, response) -> None:
        if self._end():
            self.sender.send(response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def submitted(self, handle) -> None:
        with self._lock:
            self.handle = handle
            ended = self.final      # the sink ended it before submit returned
        if ended:
            handle.cancel()

    def _end(self) -> bool:
        """Mark the request answered (True the first time only) and free its row at the
        engine's next step (a no-op once the engine sent Done)."""
        with self._lock:
            if self.final:
                return False
            self.final, h = True, self.handle
        if h is not None:
            h.cancel()
        self.on_final()
        return True


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        engines = Path(params["engines"])
        if not engines.is_absolute():       # copied into the model folder (--copy-engines)
            engines = Path(args["model_repository"]) / engines
        from specrt.runtime.batch.generator import open_batch
        self.max_num_seqs = int(params.get("max_num_seqs") or 1)
        self.queue_size = int(params.get("queue_size") or DEFAULT_QUEUE)
        self._open, self._open_lock = 0, threading.Lock()     # requests submitted and not answered yet
        # the engine's own bound is a backstop; execute checks running + waiting first
        self.batch = open_batch(engines, max_num_seqs=self.max_num_seqs, max_queue=self.max_num_seqs + self.queue_size,
                                memory=params.get("memory", "fast"))

    def execute(self, requests):
        for request in requests:
            self._submit(request)       # returns at once: the engine thread answers
        return None     # decoupled: every answer goes through a response sender

    def _submit(self, request):
        from specrt.errors import OverloadedError
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        answer = _Answer(request, self._answered)
        with self._open_lock:
            full, running = self._open >= self.max_num_seqs + self.queue_size, self._open
            self._open += not full
        if full:
            answer.sender.send(_error(
                f"{running} requests are running or waiting (max_num_seqs {self.max_num_seqs} + queue_size "
                f"{self.queue_size}): retry later, or rewrite the repository with a larger "
                "`specrt triton-repo --max-num-seqs` or `--queue-size`", "UNAVAILABLE"), flags=final)
            return
        try:
            prompt, kw = _inputs(request)
            # the engine asks is_cancelled() at every step, so a request cancelled while it waits
            # for a row ends then, not when it gets one
            answer.submitted(self.batch.submit(prompt, sink=answer.sink, poll_cancel=request.is_cancelled, **kw))
        except OverloadedError as e:
            answer.finish(_error(f"{e} (max_num_seqs {self.max_num_seqs}, queue_size {self.queue_size})",
                                 "UNAVAILABLE"))
        except _bad_input_types() as e:
            answer.finish(_bad_input(e))

    def _answered(self) -> None:
        with self._open_lock:
            self._open -= 1

    def finalize(self):
        if self.batch is not None:
            self.batch.close()      # running and waiting requests end with a FINAL error (see _Answer)
        self.batch = None
