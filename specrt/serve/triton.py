"""`specrt triton-repo ENGINES OUT`: a Triton Inference Server model repository
(Python backend, decoupled = streaming) that wraps `SpeculativeGenerator`.

    OUT/
      <model>/
        config.pbtxt       backend "python", decoupled, inputs/outputs, instance_group
        1/model.py         specrt/serve/triton_model.py (TritonPythonModel)
        engines/           only with copy_engines; otherwise config names the absolute path

Serve it with `tritonserver --model-repository OUT`; the Python backend's environment
must have specrt installed (its runtime dependencies only).
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from specrt import manifest as mf
from specrt.errors import SpecrtError
from specrt.runtime import MEMORY_MODES

MODEL_PY = Path(__file__).with_name("triton_model.py")

# (name, Triton type, dims, optional)
INPUTS = (("text_input", "TYPE_STRING", "[ 1 ]", False), ("max_tokens", "TYPE_INT32", "[ 1 ]", True),
          ("temperature", "TYPE_FP32", "[ 1 ]", True), ("top_p", "TYPE_FP32", "[ 1 ]", True),
          ("seed", "TYPE_INT64", "[ 1 ]", True), ("stop", "TYPE_STRING", "[ -1 ]", True),
          ("chat", "TYPE_BOOL", "[ 1 ]", True))
OUTPUTS = (("text_output", "TYPE_STRING", "[ 1 ]"), ("finish_reason", "TYPE_STRING", "[ 1 ]"))


class TritonRepoError(SpecrtError):
    """The model repository cannot be written as asked."""


def config_pbtxt(name: str, engines: str, *, instances: int, memory: str) -> str:
    ins = ",\n".join(f'  {{ name: "{n}" data_type: {t} dims: {d}{" optional: true" if o else ""} }}'
                     for n, t, d, o in INPUTS)
    outs = ",\n".join(f'  {{ name: "{n}" data_type: {t} dims: {d} }}' for n, t, d in OUTPUTS)
    return (f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\n'
            "# decoupled: one response per streamed text chunk, the last one flagged FINAL\n"
            "model_transaction_policy { decoupled: true }\n"
            f"input [\n{ins}\n]\noutput [\n{outs}\n]\n"
            "# each instance is its own stub process with its own generator: one request at a time each\n"
            f"instance_group [ {{ count: {instances} kind: KIND_CPU }} ]\n"
            f'parameters {{ key: "engines" value: {{ string_value: {json.dumps(engines)} }} }}\n'
            f'parameters {{ key: "memory" value: {{ string_value: "{memory}" }} }}\n')


def write_triton_repo(engines: str | Path, out: str | Path, *, model_name: str | None = None, instances: int = 1,
                      memory: str = "fast", copy_engines: bool = False) -> Path:
    """Write the repository; returns the model's folder. Refuses to overwrite a folder that
    is not a model written by this function."""
    engines = Path(engines).resolve()
    mf.load(engines)        # a typed error now beats one in Triton's log
    name = model_name or engines.name
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise TritonRepoError(f"model name {name!r}: use letters, digits, '_', '-', '.' (pass --model-name)")
    if instances < 1:
        raise TritonRepoError(f"--instances {instances}: give at least 1")
    if memory not in MEMORY_MODES:
        raise TritonRepoError(f"--memory {memory}: choose one of {', '.join(MEMORY_MODES)}")
    model = Path(out) / name
    if model.exists() and not (model / "config.pbtxt").exists():
        raise TritonRepoError(f"{model} exists and is not a Triton model folder: pick another OUT or --model-name")
    (model / "1").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(MODEL_PY, model / "1" / "model.py")
    where = str(engines)
    if copy_engines:
        if (model / "engines").exists():
            shutil.rmtree(model / "engines")
        shutil.copytree(engines, model / "engines")
        where = "engines"   # relative: model.py resolves it against the model folder
    (model / "config.pbtxt").write_text(config_pbtxt(name, where, instances=instances, memory=memory))
    return model
