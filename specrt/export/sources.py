"""Model sources: a Hugging Face directory (config.json + *.safetensors), a GGUF file, or a
Hugging Face model id (`org/name`) already in the local Hugging Face cache (HF_HUB_CACHE, or
HF_HOME/hub): specrt never downloads.

Pickled checkpoints (*.bin, *.pt) are refused: loading them executes arbitrary code.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from specrt.errors import ModelSourceError
from specrt.manifest import sha256_file
from specrt.export.specs import ArchSpec, Dims, dims_of, spec_for

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    """A reference torch model plus everything the exporter needs to rebuild it."""
    model: torch.nn.Module          # the Hugging Face model: the parity reference
    tokenizer: object               # a transformers fast tokenizer
    spec: ArchSpec
    dims: Dims
    inv_freq: torch.Tensor | None
    attention_scaling: float
    identity: dict                  # path, files and their sha256, model_type
    # (inv_freq, attention_scaling) of the layers whose Dims.rotary is "local" (Gemma 3's sliding layers)
    local_rope: tuple | None = None


# a Hub model id: "org/name" (names of letters, digits, "-", "_", "."), as huggingface_hub validates them
_MODEL_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}$")


def _resolve(path: str | Path) -> tuple[Path, str | None]:
    p = Path(path)
    if not p.exists():
        if isinstance(path, str) and _MODEL_ID.match(path) and ".." not in path:
            return _resolve(_from_hub_cache(path))
        raise ModelSourceError(f"model source {p} does not exist: pass a Hugging Face directory, a .gguf file, or "
                               "a model id (org/name) that is in the local Hugging Face cache")
    if p.is_file():
        if p.suffix != ".gguf":
            raise ModelSourceError(f"{p} is a file but not .gguf; pass a GGUF file or a directory with "
                                   "config.json and *.safetensors")
        return p.parent, p.name
    if not (p / "config.json").exists():
        raise ModelSourceError(f"{p} has no config.json: not a Hugging Face model directory")
    if not list(p.glob("*.safetensors")):
        pickled = [f.name for f in p.iterdir() if f.suffix in (".bin", ".pt", ".pth", ".ckpt")]
        hint = f" (found pickled {pickled}: convert them to safetensors first; specrt never unpickles)" if pickled else ""
        raise ModelSourceError(f"{p} has no *.safetensors weights{hint}")
    return p, None


def _from_hub_cache(model_id: str) -> Path:
    """The cached snapshot folder of `model_id` (its "main" revision), offline; a ModelSourceError
    that says how to fill the cache when it is not there."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        folder = Path(snapshot_download(model_id, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, FileNotFoundError) as e:
        raise ModelSourceError(
            f"{model_id} is neither a local path nor in the local Hugging Face cache ({constants.HF_HUB_CACHE}; "
            f"{type(e).__name__}); specrt never downloads. On a machine with network access run "
            f"`hf download {model_id}` (huggingface_hub's CLI) and copy its cache folder here, or point HF_HOME / "
            "HF_HUB_CACHE at a cache that has it, or pass the model's local directory") from None
    log.info("%s: the cached snapshot %s", model_id, folder)
    return folder


def load_source(path: str | Path) -> LoadedModel:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    directory, gguf = _resolve(path)
    kw = {"gguf_file": gguf} if gguf else {"use_safetensors": True}
    try:
        cfg = AutoConfig.from_pretrained(directory, **({"gguf_file": gguf} if gguf else {}))
        spec = spec_for(cfg.model_type)
        dims = dims_of(spec, cfg)
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, **kw).eval()
        tokenizer = AutoTokenizer.from_pretrained(directory, **({"gguf_file": gguf} if gguf else {}))
    except ModelSourceError:
        raise
    except Exception as e:  # transformers raises many types for an unreadable source
        raise ModelSourceError(f"could not load {path}: {type(e).__name__}: {e}") from e
    tables, rope_info = _rope_tables(model, cfg, spec) if spec.positions == "rope" else ({}, None)
    inv_freq, scaling = tables.get("global", (None, 1.0))
    sliding = getattr(cfg, "sliding_window", None)
    files = [directory / gguf] if gguf else sorted(directory.glob("*.safetensors")) + [directory / "config.json"]
    local = Path(path).exists()
    identity = {
        "source": str(Path(path).resolve()) if local else str(directory),
        **({} if local else {"model_id": str(path)}),   # resolved from the Hugging Face cache
        "model_type": cfg.model_type,
        "family": spec.family,
        "files": {f.name: sha256_file(f) for f in files},
        "sliding_window": sliding,
        **({"rope": rope_info} if rope_info else {}),
    }
    return LoadedModel(model, tokenizer, spec, dims, inv_freq, float(scaling), identity, tables.get("local"))


# rotary types whose frequencies change with the sequence length at run time: a static graph
# has one table. ("longrope" switches tables at original_max_position_embeddings: its short
# table is exact below that length, so the build refuses a longer --max-context instead.)
_SEQUENCE_DEPENDENT = ("dynamic",)


def _rope_tables(model, cfg, spec: ArchSpec) -> tuple[dict, dict]:
    """The rotary tables transformers itself built for this model, read off its rotary
    embedding module (what its forward multiplies positions by): kind -> (inv_freq, scaling)
    with kind "global", and "local" where the spec declares rope_local_base (Gemma 3 keeps
    one table per layer type). Also the manifest's record of them."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    rotary = next((m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")), None)
    if rotary is None:
        raise ModelSourceError(f"{spec.family}: found no rotary embedding module in {type(model).__name__}")
    kinds = {"global": "full_attention", "local": "sliding_attention"} if spec.rope_local_base else {"global": None}
    tables, info = {}, {}
    for kind, layer_type in kinds.items():
        p = (params.get(layer_type) or {}) if layer_type else params
        rope_type = p.get("rope_type", p.get("type", "default"))
        if rope_type in _SEQUENCE_DEPENDENT or rope_type not in ROPE_INIT_FUNCTIONS and rope_type != "default":
            raise ModelSourceError(f"rope_type={rope_type!r} depends on sequence length; static export needs a "
                                   "fixed frequency table")
        prefix = f"{layer_type}_" if layer_type else ""
        # original_inv_freq: the table at init (a longrope forward past its original length
        # overwrites inv_freq with the long factors in place)
        inv_freq = getattr(rotary, f"{prefix}original_inv_freq", None)
        if inv_freq is None:
            inv_freq = getattr(rotary, f"{prefix}inv_freq", None)
        if inv_freq is not None:
            scaling = getattr(rotary, f"{prefix}attention_scaling")
        else:   # a layer type no layer of this model has (a cut-down Gemma 3): transformers' function
            init = ROPE_INIT_FUNCTIONS.get(rope_type, type(rotary).compute_default_rope_parameters)
            inv_freq, scaling = init(cfg, None, layer_type=layer_type)
        tables[kind] = (inv_freq.detach().to(torch.float32).clone(), float(scaling))
        info[kind] = {"rope_type": rope_type, "rotary_dim": 2 * inv_freq.numel()}
        if rope_type == "longrope":
            info[kind]["max_context"] = int(p.get("original_max_position_embeddings")
                                            or getattr(cfg, "original_max_position_embeddings"))
    return tables, info
