"""The manifest: the one contract between the build and the runtime.

`manifest.json` sits beside the artifacts it describes. It records everything the
runtime needs (tensor names, static shapes, dtypes, files and their hashes, the
tokenizer) and everything an operator needs to trust the build (tool versions, the
device it was built for, parity numbers). Nothing is encoded in a file name.

Pure stdlib: every stage imports this module, the runtime included.
"""
from __future__ import annotations

import hashlib
import json
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specrt import __version__
from specrt.errors import GraphFileError, ManifestError

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
KV_UPDATES = ("returned", "in_place")   # ModelEntry.kv["update"]


@dataclass(frozen=True)
class Shapes:
    batch: int
    max_context: int        # prompt + generated tokens never exceed this
    prefill_chunk: int      # T of the prefill graph; long prompts are fed in chunks
    k: int                  # draft tokens per iteration; the verify graph has T = k + 1

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


@dataclass(frozen=True)
class ModelEntry:
    role: str                       # "target" | "draft"
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
    specrt_version: str = __version__
    schema_version: int = SCHEMA_VERSION
    format: str = FORMAT

    @property
    def target(self) -> ModelEntry:
        return self.models["target"]

    @property
    def draft(self) -> ModelEntry | None:
        return self.models.get("draft")

    # --- io ---------------------------------------------------------------------------
    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=False)

    def save(self, directory: Path) -> Path:
        path = Path(directory) / FILENAME
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(self.to_json())
        tmp.replace(path)  # atomic: a crash never leaves half a manifest
        return path


def load(directory: str | Path) -> Manifest:
    """Read and structurally validate `directory/manifest.json`."""
    directory = Path(directory)
    path = directory / FILENAME if directory.is_dir() or not directory.suffix else directory
    if not path.exists():
        raise ManifestError(f"no {FILENAME} in {path.parent}: build the engines first (`specrt build` or `make engines`)")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ManifestError(f"{path} is not valid JSON ({e}); rebuild the engines") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise ManifestError(f"{path} is not a specrt manifest (format={raw.get('format') if isinstance(raw, dict) else None!r}): "
                            "point at a folder written by `specrt build`, or rebuild the engines")
    if raw.get("schema_version") != SCHEMA_VERSION:
        raise ManifestError(
            f"{path} has schema_version={raw.get('schema_version')}; this specrt ({__version__}) reads "
            f"schema_version={SCHEMA_VERSION}: rebuild the engines with this version")
    try:
        models = {role: ModelEntry(**{**m, "graphs": {g: GraphEntry(**e) for g, e in m["graphs"].items()}})
                  for role, m in raw["models"].items()}
        man = Manifest(**{**raw, "shapes": Shapes(**raw["shapes"]), "models": models})
    except (KeyError, TypeError) as e:
        raise ManifestError(f"{path} is missing or has unexpected fields ({e}); rebuild the engines") from None
    if "target" not in man.models:
        raise ManifestError(f"{path} describes no target model: rebuild the engines")
    sh = man.shapes
    for name in ("batch", "max_context", "prefill_chunk", "k"):
        v = getattr(sh, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ManifestError(f"{path}: shapes.{name}={v!r} is not a positive integer; rebuild the engines")
    window = {"prefill": sh.prefill_chunk, "decode": 1, "verify": sh.k + 1}
    for role, m in man.models.items():
        for g, e in m.graphs.items():
            if g in window and e.tokens != window[g]:
                raise ManifestError(f"{path}: the {role} {g} graph has T={e.tokens} but shapes imply T={window[g]} "
                                    "(inconsistent manifest): rebuild the engines")
    return man


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def check_files(man: Manifest, directory: Path, *, hashes: bool = False) -> None:
    """Every file the manifest names exists (and, with hashes=True, matches its sha256)."""
    entries = [(m.weights["file"], m.weights["sha256"]) for m in man.models.values()]
    entries += [(g.file, g.sha256) for m in man.models.values() for g in m.graphs.values()]
    entries.append((man.tokenizer["file"], man.tokenizer["sha256"]))
    for rel, digest in entries:
        p = Path(directory) / rel
        if not p.is_file():
            raise GraphFileError(f"{p} is named by the manifest but missing: rebuild the engines")
        if hashes and sha256_file(p) != digest:
            raise GraphFileError(f"{p} does not match the sha256 in the manifest (corrupt or replaced): rebuild the engines")


def this_device() -> dict:
    return {"kind": "cpu", "backend": "onnxruntime", "machine": platform.machine(), "os": platform.system()}


def check_device(man: Manifest, backend: str = "onnxruntime") -> None:
    """Refuse artifacts built for another backend / processor / OS, with what to do."""
    here, built = this_device(), man.device
    if built.get("backend") != backend:
        raise ManifestError(
            f"engines were built for backend {built.get('backend')!r} on {built.get('kind')!r}; this runtime "
            f"runs {backend!r}: rebuild with `specrt build` on this machine")
    for key in ("kind", "machine", "os"):
        if built.get(key) != here[key]:
            raise ManifestError(
                f"engines were built for {key}={built.get(key)!r}; this machine has {key}={here[key]!r}: "
                "rebuild the engines on this machine")
