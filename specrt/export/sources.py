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
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

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
    inv_freq, scaling = None, 1.0
    if spec.positions == "rope":
        rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type == "dynamic" or rope_type not in ROPE_INIT_FUNCTIONS and rope_type != "default":
            raise ModelSourceError(f"rope_type={rope_type!r} depends on sequence length; static export needs a "
                                   "fixed frequency table")
        if rope_type == "default":
            inv_freq, scaling = _default_inv_freq(cfg, dims), 1.0
        else:
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu")
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
    }
    return LoadedModel(model, tokenizer, spec, dims, inv_freq, float(scaling), identity)


def _default_inv_freq(cfg, dims: Dims) -> torch.Tensor:
    rope = getattr(cfg, "rope_parameters", None) or {}
    theta = float(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
    d = dims.head_dim
    return 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
