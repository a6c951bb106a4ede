"""The manifest: the one contract between the build and the runtime.

`manifest.json` sits beside the artifacts it describes. It records everything the
runtime needs (tensor names, static shapes, dtypes, files and their hashes, the
tokenizer) and everything an operator needs to trust the build (tool versions, the
device it was built for, parity numbers). Nothing is encoded in a file name.

Pure stdlib: every stage imports this module, the runtime included.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specrt import __version__
from specrt.errors import ManifestError
# the files a manifest names (confinement to the folder, existence, hashes): re-exported here
from specrt.manifest_files import VERIFY_MODES, HashCheck, artifact_files, check_files, confine, sha256_file  # noqa: F401

FORMAT = "specrt-manifest"
SCHEMA_VERSION = 1
FILENAME = "manifest.json"

# tensor-name templates of the KV contract (see specrt/export/graph.py); %d = layer
IO_NAMES = {
    "input_ids": "input_ids",
    "past_len": "past_len",
    "past_key": "past_k_%d",
    "past_value": "past_v_%d",
    "logits": "logits",
    "new_key": "new_k_%d",
    "new_value": "new_v_%d",
    "present_key": "present_k_%d",      # in-place variant: the whole cache, same buffer as past
    "present_value": "present_v_%d",
}
# the batched graphs' (export/batch.py) input choosing which positions get logits; graphs
# built before it have none and return every position's logits
LOGIT_POS = "logit_pos"
KV_POS = "kv_pos"          # batched "rows" graphs: the cache positions a call reads, [L] = 0..L-1
KV_UPDATES = ("returned", "in_place")   # ModelEntry.kv["update"]
PER_LAYER_IO = tuple(k for k, v in IO_NAMES.items() if "%d" in v)
# the optional output of graphs exported with hidden_layers (export/graph.py): chosen decoder
# layers' outputs [1, T, n * hidden] fp32, for trained draft heads (issue 29)
HIDDEN_STATES = "hidden_states"


@dataclass(frozen=True)
class Shapes:
    batch: int
    max_context: int        # prompt + generated tokens never exceed this
    prefill_chunk: int      # T of the prefill graph; long prompts are fed in chunks
    k: int                  # draft tokens per iteration; the verify graph has T = k + 1

    @property
    def windows(self) -> dict[str, int]:
        """Static T of each graph: a prefill chunk, one decode token, a verify window of k+1."""
        return {"prefill": self.prefill_chunk, "decode": 1, "verify": self.k + 1}

    @property
    def kv_capacity(self) -> int:
        """Cache rows: max_context plus the widest graph window, so a padded prefill
        chunk or a verify window starting at max_context - 1 still fits."""
        return self.max_context + max(self.prefill_chunk, self.k + 1)


@dataclass(frozen=True)
class GraphEntry:
    file: str               # relative to the manifest
    tokens: int             # static T
    sha256: str
    engine: dict | None = None   # TensorRT builds: {"file": "<role>/<graph>.plan", "sha256", "bytes"}
    # graphs of the batched engine (the "batch" model, export/batch.py): "dynamic" = a symbolic
    # row count; dynamic_tokens: T is symbolic too (`tokens` is then 1, the smallest call)
    batch: str | None = None
    dynamic_tokens: bool = False


@dataclass(frozen=True)
class ModelEntry:
    role: str                       # "target" | "draft" | "batch" (the target with a batch dimension)
                                    # | "batch_draft" (a draft model with a batch dimension, own cache)
    family: str
    precision: str                  # "fp32" | "int8-dynamic" | ...
    dims: dict                      # layers, hidden, heads, kv_heads, head_dim, vocab, ...
    graphs: dict[str, GraphEntry]   # "prefill" | "decode" | "verify"
    weights: dict                   # {"file", "sha256", "bytes", "initializers"}
    source: dict                    # path, model_type, input file hashes, how it was derived
    kv: dict                        # {"dtype", "layout", "update", "shares_cache_with"}
    io: dict = field(default_factory=lambda: dict(IO_NAMES))
    parity: dict = field(default_factory=dict)

    @property
    def layers(self) -> int:
        return int(self.dims["layers"])

    @property
    def shares_cache_with(self) -> str | None:
        return self.kv.get("shares_cache_with")

    @property
    def in_place(self) -> bool:
        """True when the graphs write new K/V into the cache buffers themselves
        (outputs present_* bound to the past_* buffers), False when they return them."""
        return self.kv.get("update", "returned") == "in_place"


@dataclass(frozen=True)
class Manifest:
    shapes: Shapes
    models: dict[str, ModelEntry]
    tokenizer: dict                 # {"file", "sha256", "chat_template", "eos_token_ids", "bos_token_id", ...}
    device: dict                    # {"kind": "cpu", "backend": "onnxruntime", "machine", "os"}
    tools: dict                     # versions of the tools that built it
    build: dict = field(default_factory=dict)   # the config that produced it, timings
    # TensorRT builds: {"tensorrt_version", "gpu_name", "compute_capability",
    # "hardware_compatibility_level", "builder": {...}, "timing_cache": {...}, "build_log": [...]}
    engines: dict | None = None
    # `specrt quality --record`: this folder's row of the quality table, with its reference and prompts
    quality: dict | None = None
    # proposals that ship with the engines: {"ngrams": {"file", "sha256", "bytes", ...}} (runtime/ngrams.py)
    proposers: dict | None = None
    specrt_version: str = __version__
    schema_version: int = SCHEMA_VERSION
    format: str = FORMAT

    @property
    def target(self) -> ModelEntry:
        return self.models["target"]

    @property
    def draft(self) -> ModelEntry | None:
        return self.models.get("draft")

    @property
    def batch(self) -> ModelEntry | None:
        """The target with a batch dimension (`specrt build --batch`), for the batched engine."""
        return self.models.get("batch")

    @property
    def batch_draft(self) -> ModelEntry | None:
        """A separate draft model with a batch dimension and its own cache (`--batch` with a
        draft model or truncate:N), run inside the batch by the batched engine."""
        return self.models.get("batch_draft")

    # --- io ---------------------------------------------------------------------------
    def to_json(self) -> str:
        raw = asdict(self)
        for key in ("engines", "quality", "proposers"):  # absent unless there (ONNX-only builds, ...)
            if raw[key] is None:
                del raw[key]
        for m in raw["models"].values():
            for g in m["graphs"].values():
                for key, default in (("engine", None), ("batch", None), ("dynamic_tokens", False)):
                    if g[key] == default:
                        del g[key]
        return json.dumps(raw, indent=2, sort_keys=False)

    def save(self, directory: Path) -> Path:
        path = Path(directory) / FILENAME
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(self.to_json())
        tmp.replace(path)  # atomic: a crash never leaves half a manifest
        return path


def load(directory: str | Path) -> Manifest:
    """Read and validate `directory/manifest.json`: its structure, shapes, the files it names
    (inside `directory`, see manifest_files.py) and the tokenizer's special ids."""
    directory = Path(directory)
    if directory.is_dir():
        path = directory / FILENAME
    elif directory.name == FILENAME and directory.is_file():
        raise ManifestError(f"{directory} is the manifest itself: give the engine folder that holds it, "
                            f"{directory.parent}")
    elif not directory.exists():
        path = directory / FILENAME
    else:
        raise ManifestError(f"{directory} is a file, not an engine folder: give the folder written by "
                            f"`specrt build` (the one holding {FILENAME})")
    if not path.exists():
        raise ManifestError(f"no {FILENAME} in {path.parent}: build the engines first (`specrt build` or `make engines`)")
    if not path.is_file():
        raise ManifestError(f"{path} is not a file: point at a folder written by `specrt build`, or rebuild the engines")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ManifestError(f"{path} is not valid JSON ({e}); rebuild the engines") from None
    except OSError as e:
        raise ManifestError(f"{path} cannot be read ({e.strerror}): check its permissions, or rebuild the engines") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise ManifestError(f"{path} is not a specrt manifest (format={raw.get('format') if isinstance(raw, dict) else None!r}): "
                            "point at a folder written by `specrt build`, or rebuild the engines")
    if raw.get("schema_version") != SCHEMA_VERSION:
        raise ManifestError(
            f"{path} has schema_version={raw.get('schema_version')}; this specrt ({__version__}) reads "
            f"schema_version={SCHEMA_VERSION}: rebuild the engines with this version")
    try:
        _check_structure(raw)
        models = {role: ModelEntry(**{**m, "graphs": {g: GraphEntry(**e) for g, e in m["graphs"].items()}})
                  for role, m in raw["models"].items()}
        man = Manifest(**{**raw, "shapes": Shapes(**raw["shapes"]), "models": models})
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise ManifestError(f"{path} is missing or has unexpected fields ({type(e).__name__}: {e}); "
                            "rebuild the engines") from None
    if "target" not in man.models:
        raise ManifestError(f"{path} describes no target model: rebuild the engines")
    sh = man.shapes
    for name in ("batch", "max_context", "prefill_chunk", "k"):
        v = getattr(sh, name)
        if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= MAX_SHAPE:
            raise ManifestError(f"{path}: shapes.{name}={v!r} is not an integer in [1, {MAX_SHAPE}]; rebuild the engines")
    window = sh.windows
    for role, m in man.models.items():
        for g, e in m.graphs.items():
            # a quantized target's decode graph may run 2 rows (builder/gates/rows.py): one
            # padding row in a plain step, a guessed token in a pair round (runtime/batch/engine.py)
            wide_decode = role == "target" and g == "decode" and e.tokens == DECODE_PAIR_ROWS
            if g in window and e.tokens != window[g] and not wide_decode and not e.dynamic_tokens:
                raise ManifestError(f"{path}: the {role} {g} graph has T={e.tokens} but shapes imply T={window[g]} "
                                    "(inconsistent manifest): rebuild the engines")
        need = REQUIRED_GRAPHS[role if role in ("target", "batch", "batch_draft")
                               else ("shared" if m.shares_cache_with else "own")]
        missing = [g for g in need if g not in m.graphs]
        if missing:
            raise ManifestError(f"{path}: the {role} model has no {', '.join(missing)} graph (it needs "
                                f"{', '.join(need)}): the manifest is damaged or incomplete; rebuild the engines")
        _check_initializers(path, role, m)
    bd = man.batch_draft
    if bd is not None and (man.batch is None or bd.dims["vocab"] != man.batch.dims["vocab"]):
        raise ManifestError(f"{path}: models.batch_draft needs a batched target (models.batch) with its vocabulary "
                            f"({bd.dims['vocab']}): the manifest is damaged or incomplete; rebuild the engines")
    _check_special_ids(path, man)
    confine(man, path.parent, path)
    return man


MAX_SHAPE = 1 << 24      # no static shape (tokens, rows) is larger: beyond it a damaged manifest, not a model
DECODE_PAIR_ROWS = 2    # the widest decode graph a target may have (T=2: plain steps pad one row)

# graphs each model needs: the target always has all three (plain and speculative use
# them); a draft that reads the target's cache only steps, a draft with its own prefills
REQUIRED_GRAPHS = {"target": ("prefill", "decode", "verify"), "shared": ("decode",), "own": ("prefill", "decode"),
                   "batch": ("step",),   # one graph, [rows, T] ids, for prefill chunks and decode steps
                   "batch_draft": ("step",)}
ROLES = ("target", "draft", "batch", "batch_draft")
_DICT_FIELDS = ("shapes", "models", "tokenizer", "device", "tools")
_MODEL_DICT_FIELDS = ("dims", "graphs", "weights", "source", "kv")
HW_COMPAT_LEVELS = ("none", "ampere_plus", "same_compute_capability")   # engines.hardware_compatibility_level


def _check_structure(raw: dict) -> None:
    """Types the dataclasses cannot check: a hand-edited field of the wrong kind must be a
    ManifestError here, not an AttributeError deep in the runtime."""
    for name in _DICT_FIELDS:
        if not isinstance(raw.get(name), dict):
            raise TypeError(f"{name} must be an object, got {type(raw.get(name)).__name__}")
    for name in ("build", "quality"):    # optional objects
        if raw.get(name) is not None and not isinstance(raw[name], dict):
            raise TypeError(f"{name} must be an object, got {type(raw[name]).__name__}")
    bad = [k for k in ("kind", "backend", "machine", "os", "int8_kernels") if not isinstance(raw["device"].get(k, ""), str)]
    if bad:
        raise TypeError(f"device.{bad[0]} must be a string")
    for role, m in raw["models"].items():
        if role not in ROLES or not isinstance(m, dict):
            raise TypeError(f"models.{role} must be an object named target, draft, batch or batch_draft")
        for name in _MODEL_DICT_FIELDS:
            if not isinstance(m.get(name), dict):
                raise TypeError(f"models.{role}.{name} must be an object, got {type(m.get(name)).__name__}")
        for g, e in m["graphs"].items():
            if not isinstance(e, dict) or not isinstance(e.get("file"), str) or not _count(e.get("tokens")):
                raise TypeError(f"models.{role}.graphs.{g} must have a string file and a positive integer tokens")
            if e.get("engine") is not None:
                _check_engine_file(f"models.{role}.graphs.{g}.engine", e["engine"])
            if e.get("batch") not in (None, "dynamic") or not isinstance(e.get("dynamic_tokens", False), bool):
                raise ValueError(f"models.{role}.graphs.{g}: batch={e.get('batch')!r} (expected \"dynamic\" or "
                                 f"absent) or dynamic_tokens={e.get('dynamic_tokens')!r} (expected true/false)")
        if role in ("batch", "batch_draft") and any(e.get("batch") != "dynamic" for e in m["graphs"].values()):
            raise ValueError(f"models.{role}: every graph of a batched model needs batch=\"dynamic\"")
        for key in ("layers", "kv_heads", "head_dim", "vocab"):
            v = m["dims"].get(key)
            if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= MAX_SHAPE:
                raise ValueError(f"models.{role}.dims.{key}={v!r} is not an integer in [1, {MAX_SHAPE}]")
        hidden = m["dims"].get("hidden_layers")
        if hidden is not None and not (isinstance(hidden, list) and hidden and all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < m["dims"]["layers"] for i in hidden)
                and sorted(set(hidden)) == hidden):
            raise ValueError(f"models.{role}.dims.hidden_layers={hidden!r} must be increasing layer indices in "
                             f"[0, {m['dims']['layers']})")
        if (hidden is not None) != bool(m.get("io", {}).get("hidden_states")) or hidden is not None and not (
                isinstance(m["dims"].get("hidden"), int) and 1 <= m["dims"]["hidden"] <= MAX_SHAPE):
            raise ValueError(f"models.{role}: dims.hidden_layers ({hidden!r}) and io.hidden_states "
                             f"({m.get('io', {}).get('hidden_states')!r}) come together, with dims.hidden")
        w = m["weights"]
        if not (isinstance(w.get("file"), str) and isinstance(w.get("bytes"), int) and isinstance(w.get("sha256"), str)
                and isinstance(w.get("initializers"), dict)):
            raise TypeError(f"models.{role}.weights needs file, bytes, sha256 and initializers")
        if m["kv"].get("update", "returned") not in KV_UPDATES:
            raise ValueError(f"models.{role}.kv.update={m['kv'].get('update')!r}; expected one of {KV_UPDATES}")
        if m["kv"].get("shares_cache_with") not in ((None, "target") if role == "draft" else (None,)):
            raise ValueError(f"models.{role}.kv.shares_cache_with={m['kv'].get('shares_cache_with')!r}; a draft may "
                             "share the target's cache (\"target\") or have its own (null)")
        _check_io(f"models.{role}.io", m.get("io", IO_NAMES), m["kv"].get("update", "returned"))
    tok = raw["tokenizer"]
    if not (isinstance(tok.get("file"), str) and isinstance(tok.get("sha256"), str)):
        raise TypeError("tokenizer needs a string file and sha256")
    if tok.get("chat_template") is not None and not isinstance(tok["chat_template"], str):
        raise TypeError("tokenizer.chat_template must be a string or null")
    if not isinstance(tok.get("eos_token_ids", []), list) or not all(
            isinstance(i, int) and not isinstance(i, bool) for i in tok.get("eos_token_ids", [])):
        raise TypeError("tokenizer.eos_token_ids must be a list of integers")
    _check_engines(raw)
    props = raw.get("proposers")
    if props is not None:
        if not isinstance(props, dict):
            raise TypeError("proposers must be an object")
        for name, e in props.items():
            _check_engine_file(f"proposers.{name}", e)


def _count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_SHAPE


# io entries that are row counts, not tensor names: a call runs at least min_rows rows (n*T), and
# a multiple of row_multiple (kernels that round a call's odd last row apart: docs/batching.md)
IO_COUNTS = ("min_rows", "row_multiple")


def _check_io(where: str, io, update: str) -> None:
    """Tensor names: strings; the per-layer ones a template with one %d, the others none;
    every name the graphs' cache update binds is there."""
    if not isinstance(io, dict):
        raise TypeError(f"{where} must be an object of tensor names")
    need = ("input_ids", "past_len", "past_key", "past_value", "logits") + \
        (("present_key", "present_value") if update == "in_place" else ("new_key", "new_value"))
    missing = [k for k in need if k not in io]
    if missing:
        raise ValueError(f"{where} has no {', '.join(missing)} (tensor names the graphs are bound by)")
    for key, name in io.items():
        if key in IO_COUNTS:
            if not (isinstance(name, int) and not isinstance(name, bool) and 1 <= name <= 64):
                raise ValueError(f"{where}.{key}={name!r} must be an integer in [1, 64]")
            continue
        if key == "dtypes":
            if not (isinstance(name, dict) and all(isinstance(v, str) for v in name.values())):
                raise TypeError(f"{where}.dtypes must be an object of dtype names")
            continue
        per_layer = key in PER_LAYER_IO
        if not (isinstance(name, str) and name and name.count("%") == (1 if per_layer else 0)
                and (not per_layer or "%d" in name)):
            raise ValueError(f"{where}.{key}={name!r} is not a tensor name"
                             + (" template with one %d for the layer" if per_layer else " (no %)"))


def _check_engine_file(where: str, e) -> None:
    if not (isinstance(e, dict) and isinstance(e.get("file"), str) and isinstance(e.get("sha256"), str)
            and isinstance(e.get("bytes"), int) and not isinstance(e.get("bytes"), bool) and e["bytes"] > 0):
        raise TypeError(f"{where} needs a string file, a string sha256 and a positive integer bytes")


def _check_engines(raw: dict) -> None:
    """The engine fields of a TensorRT build: the top-level `engines` object, and an engine
    file on every graph (older and ONNX-only manifests have neither)."""
    eng = raw.get("engines")
    with_engine = [f"{role}.{g}" for role, m in raw["models"].items() for g, e in m["graphs"].items()
                   if e.get("engine") is not None]
    if eng is None:
        if with_engine:   # (a device without engines is the backend's to refuse, with its own message)
            raise ValueError(f"the graphs {', '.join(with_engine)} name engine files but the top-level engines "
                             "object (TensorRT version, GPU, compute capability, builder settings) is missing")
        return
    if not isinstance(eng, dict):
        raise TypeError(f"engines must be an object, got {type(eng).__name__}")
    for key in ("tensorrt_version", "gpu_name", "compute_capability"):
        if not isinstance(eng.get(key), str) or not eng[key]:
            raise TypeError(f"engines.{key} must be a non-empty string")
    cc = eng["compute_capability"].split(".")
    if len(cc) != 2 or not all(x.isdigit() for x in cc):
        raise ValueError(f"engines.compute_capability={eng['compute_capability']!r} is not MAJOR.MINOR")
    if eng.get("hardware_compatibility_level") not in HW_COMPAT_LEVELS:
        raise ValueError(f"engines.hardware_compatibility_level={eng.get('hardware_compatibility_level')!r}; "
                         f"expected one of {HW_COMPAT_LEVELS}")
    if not isinstance(eng.get("builder"), dict):
        raise TypeError("engines.builder must be an object")
    missing = [f"{role}.{g}" for role, m in raw["models"].items() for g, e in m["graphs"].items()
               if e.get("engine") is None]
    if missing:
        raise ValueError(f"the graphs {', '.join(missing)} have no engine file in a TensorRT build")


def _check_special_ids(path: Path, man: Manifest) -> None:
    """End-of-sequence ids are token ids of the target's vocabulary, and a chat model has one
    (without it a reply runs on past the end of its turn until max tokens)."""
    vocab, tok = int(man.target.dims["vocab"]), man.tokenizer
    eos = tok.get("eos_token_ids", [])
    bad = [i for i in eos if not 0 <= i < vocab]
    if bad:
        raise ManifestError(f"{path}: tokenizer.eos_token_ids has {bad}, outside the target's vocabulary [0, {vocab}) "
                            "(damaged manifest): restore it or rebuild the engines")
    if tok.get("chat_template") and not eos:
        raise ManifestError(f"{path}: tokenizer.eos_token_ids is empty but the model has a chat template: chat "
                            "replies would never stop at the end of a turn: restore the manifest or rebuild the engines")
    bos = tok.get("bos_token_id")
    if bos is not None and (not isinstance(bos, int) or isinstance(bos, bool) or not 0 <= bos < vocab):
        raise ManifestError(f"{path}: tokenizer.bos_token_id={bos!r} is not a token id of the vocabulary [0, {vocab}): "
                            "restore the manifest or rebuild the engines")


def _check_initializers(path: Path, role: str, m: ModelEntry) -> None:
    """Each weights.bin entry [offset, length, dtype, shape] lies inside the file and its
    length matches dtype x shape (memory-mapped sharing reads exactly these bytes)."""
    import numpy as np
    size = m.weights["bytes"]
    for name, entry in m.weights["initializers"].items():
        try:
            offset, length, dtype, shape = entry
            itemsize = np.dtype(dtype).itemsize if np.dtype(dtype).kind in "fiu" else -1   # numbers only
            ints = [offset, length, *shape]
            ok = (all(isinstance(v, int) and not isinstance(v, bool) for v in ints) and 0 <= offset
                  and offset + length <= size and all(d >= 0 for d in shape)
                  and int(np.prod(shape, dtype=np.int64)) * itemsize == length)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ManifestError(f"{path}: {role} initializer {name!r} has an invalid entry {entry!r} for a "
                                f"{size}-byte weights file (damaged manifest): rebuild the engines")


# which machine a folder may run on (its device, int8 path, gated kernels): re-exported here
from specrt.manifest_device import (  # noqa: E402,F401
    check_device, check_gated, check_int8_kernels, gated_kernels, gpu_device, this_device, uses_int8_kernels)
