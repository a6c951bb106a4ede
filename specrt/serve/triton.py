"""`specrt triton-repo ENGINES OUT`: a Triton Inference Server model repository
(Python backend, decoupled = streaming) whose instances each run one `BatchGenerator`, the
engine every other caller runs: one row by default, or `max_num_seqs` rows (engines built with
`specrt build --batch`) serving up to N requests at once in one instance.

    OUT/
      <model>/
        config.pbtxt       backend "python", decoupled, inputs/outputs, instance_group
        1/model.py         specrt/serve/triton_model.py (TritonPythonModel)
        engines/           only with copy_engines; otherwise config names the absolute path
        .specrt-triton     the marker: a model folder without it is not overwritten (unless force)

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
MARKER = ".specrt-triton"   # in every model folder write_triton_repo writes

# (name, Triton type, dims, optional)
INPUTS = (("text_input", "TYPE_STRING", "[ 1 ]", False), ("max_tokens", "TYPE_INT32", "[ 1 ]", True),
          ("temperature", "TYPE_FP32", "[ 1 ]", True), ("top_p", "TYPE_FP32", "[ 1 ]", True),
          ("seed", "TYPE_INT64", "[ 1 ]", True), ("stop", "TYPE_STRING", "[ -1 ]", True),
          ("chat", "TYPE_BOOL", "[ 1 ]", True),
          # structured output as JSON text: {"json_schema": {...}}, {"regex": "..."}, ... (runtime/grammar.py)
          ("structured", "TYPE_STRING", "[ 1 ]", True))
OUTPUTS = (("text_output", "TYPE_STRING", "[ 1 ]"), ("finish_reason", "TYPE_STRING", "[ 1 ]"))


class TritonRepoError(SpecrtError):
    """The model repository cannot be written as asked."""


def config_pbtxt(name: str, engines: str, *, instances: int, memory: str, max_num_seqs: int = 1,
                 queue_size: int = 8) -> str:
    ins = ",\n".join(f'  {{ name: "{n}" data_type: {t} dims: {d}{" optional: true" if o else ""} }}'
                     for n, t, d, o in INPUTS)
    outs = ",\n".join(f'  {{ name: "{n}" data_type: {t} dims: {d} }}' for n, t, d in OUTPUTS)
    params = {"engines": engines, "memory": memory, "max_num_seqs": str(max_num_seqs), "queue_size": str(queue_size)}
    if max_num_seqs == 1:
        note = ("# each instance is its own stub process with its own engine (execute returns at once, the engine\n"
                "# thread streams the answers): one request at a time each, count = requests at once.\n"
                "# queue_size: requests that may wait for it (then an UNAVAILABLE error)\n")
    else:
        note = (f"# one batched engine per instance serves up to {max_num_seqs} requests at once (execute returns at\n"
                "# once, the engine thread streams the answers): count 1 is right, each more instance is another\n"
                "# copy of the weights. queue_size: requests that may wait for a row (then an UNAVAILABLE error)\n")
    return (f'name: "{name}"\nbackend: "python"\nmax_batch_size: 0\n'
            "# decoupled: one response per streamed text chunk, the last one flagged FINAL\n"
            "model_transaction_policy { decoupled: true }\n"
            f"input [\n{ins}\n]\noutput [\n{outs}\n]\n{note}"
            f"instance_group [ {{ count: {instances} kind: KIND_CPU }} ]\n"
            + "".join(f'parameters {{ key: "{k}" value: {{ string_value: {json.dumps(v)} }} }}\n'
                      for k, v in params.items()))


def write_triton_repo(engines: str | Path, out: str | Path, *, model_name: str | None = None, instances: int = 1,
                      memory: str = "fast", copy_engines: bool = False, force: bool = False,
                      max_num_seqs: int | None = None, queue_size: int = 8) -> Path:
    """Write the repository; returns the model's folder. Refuses to overwrite a folder that
    this function did not write (no MARKER in it) unless `force`. max_num_seqs: rows of each
    instance's engine (None: 1, one request at a time per instance; more need a batched model);
    queue_size: requests that may wait for one of its rows."""
    engines = Path(engines).resolve()
    man = mf.load(engines)        # a typed error now beats one in Triton's log
    name = model_name or engines.name
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise TritonRepoError(f"model name {name!r}: use letters, digits, '_', '-', '.' (pass --model-name)")
    if instances < 1:
        raise TritonRepoError(f"--instances {instances}: give at least 1")
    if memory not in MEMORY_MODES:
        raise TritonRepoError(f"--memory {memory}: choose one of {', '.join(MEMORY_MODES)}")
    if max_num_seqs is not None and max_num_seqs != 1:
        _check_batched(man, engines, max_num_seqs)
    if queue_size < 0:
        raise TritonRepoError(f"--queue-size {queue_size}: give 0 (no waiting) or more")
    if memory != "fast" and man.batch is not None:
        raise TritonRepoError(f"--memory {memory} sets up a folder's one-row graphs; {engines} runs its batched model "
                              "(one copy of the weights for every row): leave --memory out")
    _check_destination(Path(out), Path(out) / name, force)
    model = Path(out) / name
    try:
        (model / "1").mkdir(parents=True, exist_ok=True)
        (model / MARKER).write_text("written by `specrt triton-repo`; it rewrites this folder as a whole\n")
        shutil.copyfile(MODEL_PY, model / "1" / "model.py")
        where = str(engines)
        if copy_engines:
            if (model / "engines").is_dir() and not (model / "engines").is_symlink():
                shutil.rmtree(model / "engines")
            elif (model / "engines").exists() or (model / "engines").is_symlink():
                (model / "engines").unlink()
            shutil.copytree(engines, model / "engines")
            where = "engines"   # relative: model.py resolves it against the model folder
        (model / "config.pbtxt").write_text(config_pbtxt(name, where, instances=instances, memory=memory,
                                                                max_num_seqs=max_num_seqs or 1, queue_size=queue_size))
    except OSError as e:
        raise TritonRepoError(f"cannot write the model folder {model} ({e.strerror or e}): check that OUT is a "
                              "writable folder with room, or choose another OUT") from None
    return model


def _check_batched(man, engines: Path, max_num_seqs: int) -> None:
    if not 1 <= max_num_seqs <= 256:        # open_batch's range
        raise TritonRepoError(f"--max-num-seqs {max_num_seqs}: give an integer in [1, 256]")
    if man.batch is None:
        raise TritonRepoError(f"{engines} has no batched model, so --max-num-seqs cannot be served: rebuild the "
                              "engines with `specrt build ... --batch`, or leave --max-num-seqs out (one request at "
                              "a time per instance, --instances N)")


def _check_destination(out: Path, model: Path, force: bool) -> None:
    """Before writing anything: OUT is a folder (or absent), and the model folder is absent or
    one this function wrote."""
    for p in (out, *out.parents):
        if p.exists() and not p.is_dir():
            raise TritonRepoError(f"{p} is a file, not a folder: the model repository {out} must be a folder; "
                                  "choose another OUT")
    if model.exists() and not model.is_dir():
        raise TritonRepoError(f"{model} is a file: pick another OUT or --model-name")
    if model.is_dir() and not (model / MARKER).is_file() and not force:
        held = sorted(str(p.relative_to(model)) for p in model.rglob("*") if p.is_file())
        shown = ", ".join(held[:5]) + (f" and {len(held) - 5} more" if len(held) > 5 else "")
        raise TritonRepoError(f"{model} exists and was not written by `specrt triton-repo` (no {MARKER} marker; it "
                              f"holds {shown or 'nothing yet'}): pick another OUT or --model-name, or pass --force to "
                              "overwrite its config.pbtxt and 1/model.py (and, with --copy-engines, replace its "
                              "engines/ folder)")
