"""A stand-in for Triton's `triton_python_backend_utils` (which only exists inside the
server's Python stub): just the calls model.py makes, recording what it sends."""
from __future__ import annotations

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
    CANCELLED = 7

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
    def __init__(self):
        self.sent: list[tuple[InferenceResponse, int]] = []

    def send(self, response=None, flags: int = 0):
        self.sent.append((response, flags))


class Request:
    def __init__(self, cancel_after: int | None = None, **inputs):
        self.inputs = {k: Tensor(k, np.asarray(v)) for k, v in inputs.items()}
        self.sender, self.cancel_after, self.checks = Sender(), cancel_after, 0

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
