"""Model sources: a Hugging Face directory (config.json + *.safetensors) or a GGUF file.

Pickled checkpoints (*.bin, *.pt) are refused: loading them executes arbitrary code.
"""
from __future__ import annotations

import logging
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


def _resolve(path: str | Path) -> tuple[Path, str | None]:
    p = Path(path)
    if not p.exists():
        raise ModelSourceError(f"model source {p} does not exist: pass a Hugging Face directory or a .gguf file")
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
    identity = {
        "source": str(Path(path).resolve()),
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
