"""A stand-in for Triton's `triton_python_backend_utils` (which only exists inside the
server's Python stub): just the calls model.py makes, recording what it sends, from any
thread (the batched model answers from its engine thread)."""
from __future__ import annotations

import threading
import types

import numpy as np


class Tensor:
    def __init__(self, name: str, array: np.ndarray):
        self._name, self._array = name, array

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array


class TritonError:
    INTERNAL, INVALID_ARG, UNAVAILABLE, CANCELLED = 2, 4, 5, 7

    def __init__(self, message: str, code: int | None = None):
        self._message, self._code = message, code

    def message(self) -> str:
        return self._message

    def code(self):
        return self._code


class InferenceResponse:
    def __init__(self, output_tensors=None, error=None):
        self.output_tensors, self.error = output_tensors or [], error

    def output(self, name: str) -> str:
        return next(t for t in self.output_tensors if t.name() == name).as_numpy()[0].decode()


class Sender:
    """gate: send waits until it is set (holds the engine thread); `held` is set once a send
    waits for it. fail: send raises, as Triton's does when the client is gone."""

    def __init__(self, gate: threading.Event | None = None, fail: bool = False):
        self.sent: list[tuple[InferenceResponse, int]] = []
        self.gate, self.fail = gate, fail
        self.held = threading.Event()
        self.threads: set[str] = set()     # names of the threads that sent
        self._final = threading.Event()
        self._lock = threading.Lock()

    def send(self, response=None, flags: int = 0):
        if self.gate is not None:
            if not self.gate.is_set():
                self.held.set()
            assert self.gate.wait(60), "the test never opened the gate"
        if self.fail:
            raise RuntimeError("the stand-in sender fails on purpose")
        with self._lock:
            self.sent.append((response, flags))
            self.threads.add(threading.current_thread().name)
        if flags & 1:
            self._final.set()

    @property
    def finals(self) -> int:
        with self._lock:
            return sum(1 for _, f in self.sent if f & 1)

    def wait(self, timeout: float = 60.0) -> "Sender":
        """Until a FINAL response was sent (a hang guard, not a time bound)."""
        assert self._final.wait(timeout), f"no FINAL response within {timeout} s: {self.sent}"
        return self


class Request:
    def __init__(self, cancel_after: int | None = None, gate: threading.Event | None = None, fail_send: bool = False,
                 **inputs):
        self.inputs = {k: Tensor(k, np.asarray(v)) for k, v in inputs.items()}
        self.sender, self.cancel_after, self.checks = Sender(gate, fail_send), cancel_after, 0

    def get_response_sender(self) -> Sender:
        return self.sender

    def is_cancelled(self) -> bool:
        self.checks += 1
        return self.cancel_after is not None and self.checks > self.cancel_after


def module() -> types.ModuleType:
    m = types.ModuleType("triton_python_backend_utils")
    m.Tensor, m.TritonError, m.InferenceResponse = Tensor, TritonError, InferenceResponse
    m.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    m.get_input_tensor_by_name = lambda request, name: request.inputs.get(name)
    return m
