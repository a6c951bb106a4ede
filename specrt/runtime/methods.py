"""Decoding methods, with what each needs declared (TensorRT-LLM's SpeculativeDecodingMode:
capability predicates instead of string checks).

    speculative   a draft model proposes; with the build's step costs, adaptive k also picks
                  plain steps, prompt lookup's guess and pair rounds (runtime/batch/policy.py)
    plain         one target decode step per token
    lookup        prompt lookup proposes (no draft model); greedy only
"""
from __future__ import annotations

from enum import Enum

from specrt.errors import SamplingParamsError


class Method(str, Enum):
    SPECULATIVE = "speculative"
    PLAIN = "plain"
    LOOKUP = "lookup"

    @classmethod
    def parse(cls, value) -> "Method":
        try:
            return cls(value)
        except ValueError:
            raise SamplingParamsError(f"method={value!r}; choose one of {METHODS}") from None

    @property
    def needs_draft(self) -> bool:
        return self is Method.SPECULATIVE

    @property
    def greedy_only(self) -> bool:
        return self is Method.LOOKUP

    @property
    def target_graphs(self) -> tuple[str, ...]:
        """The target graphs besides prefill: plain steps need the decode graph, proposals the
        verify graph (prompt lookup both: a round without a guess is a plain step)."""
        return {Method.SPECULATIVE: ("verify",), Method.PLAIN: ("decode",),
                Method.LOOKUP: ("decode", "verify")}[self]


METHODS = tuple(m.value for m in Method)
