"""specrt command line: build, generate, bench, inspect.

The parser and `main`; each subcommand's `cmd_<name>` is in commands.py.

`build` imports the exporter (torch); the other commands import only the runtime.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from specrt import __version__
from specrt.cli_text import HelpFormatter, in_flag_words, show_build_defaults
from specrt.commands import cmd_bench, cmd_build, cmd_check_modes, cmd_generate, cmd_inspect, cmd_profile, \
    cmd_qdq, cmd_quality, cmd_retime, cmd_serve, cmd_triton_repo
from specrt.errors import SpecrtError


def make_parser() -> argparse.ArgumentParser:
    """The `specrt` parser; its subcommands' parsers are `parser.commands.choices[name]`."""
    p = _Parser(prog="specrt", description=__doc__.splitlines()[0])
    p.add_argument("-v", "--verbose", action="store_true", help="log progress; show the traceback of an unexpected "
                   "error")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.commands = p.add_subparsers(dest="cmd", required=True)

    b = sub.add_parser("build", help="export + calibrate + build engines into a folder with a manifest")
    b.add_argument("--preset", help="a named configuration, e.g. smollm2")
    b.add_argument("--target", help="Hugging Face directory (config.json + safetensors) or .gguf file")
    b.add_argument("--draft", help="int8 | none | truncate:N | path to a draft model")
    b.add_argument("--out", help="output folder")
    b.add_argument("--draft-vocab", type=int, metavar="N",
                   help="int8 drafts: score only N tokens in the draft's LM head (the most frequent in calibration "
                        "text; lossless, the target verifies every token; acceptance drops by the held-out "
                        "coverage loss recorded in the manifest). Default: the full head")
    b.add_argument("--max-context", type=int, help="the most tokens a generation holds, prompt included")
    b.add_argument("--prefill-chunk", type=int, help="prompt tokens per prefill step (the prefill graph's T)")
    b.add_argument("--k", type=int, help="draft tokens per iteration (verify graph has k+1 tokens)")
    b.add_argument("--precision", choices=("fp32", "int8", "int4", "int8row"),
                   help="the target's weights: fp32 (default, the exact reference), int8 or int4 (ONNX Runtime "
                        "MatMulNBits), int8row (int8 per channel, ONNX Runtime's int8 GEMM: VNNI/AMX where the CPU "
                        "has them; docs/precision.md); a preset then writes to <preset out>-<precision>")
    b.add_argument("--block-size", type=int, help="int8/int4: weights per quantization block (default 32)")
    b.add_argument("--accuracy-level", type=int, choices=(0, 1, 2, 3, 4),
                   help="int8/int4: MatMulNBits compute type, 1 = fp32, 4 = int8 (default: 4 for both; docs/precision.md)")
    b.add_argument("--lm-head", choices=("quantized", "fp32"), help="int8/int4: quantize the LM head or keep it fp32")
    b.add_argument("--attention", choices=("gqa", "portable", "standard"),
                   help="gqa (default): ONNX Runtime's fused GroupQueryAttention, KV written in place; "
                        "portable: standard ONNX ops only; standard: opset-24 TensorScatter + Attention, "
                        "KV written in place (the TensorRT graph). The GPU backends choose their own")
    b.add_argument("--backend", choices=("ort-cpu", "ort-cuda", "tensorrt", "auto"),
                   help="ort-cpu (default): fp32/int8/int4 graphs for ONNX Runtime CPU; ort-cuda: fp16 gqa graphs "
                        "for ONNX Runtime CUDA (builds on a CPU machine too, CUDA unverified); tensorrt: fp16 "
                        "standard graphs + TensorRT engines (needs TensorRT and a GPU); auto: the best this "
                        "machine runs. A preset then writes to <preset out>-<backend>; GPU builds default to "
                        "--draft none")
    b.add_argument("--ngram-tokens", type=int, metavar="N",
                   help="int8/int4 targets: generate N tokens of the target's own greedy text on the calibration "
                        "prompts and ship its n-gram table, the guesses of pair rounds (default 8192, ~50 s for "
                        "SmolLM2 int4; 0: none)")
    b.add_argument("--no-measure-costs", dest="measure_costs", action="store_false", default=None,
                   help="do not time the built graphs: no speculation plan in the manifest, so generation uses a "
                        "fixed k (adaptive k needs the measured costs); the manifest then has no timings")
    b.add_argument("--batch", action="store_true", default=None,
                   help="also export the target with a batch dimension, so that `specrt serve --max-num-seqs N` "
                        "decodes many requests at once on one copy of the weights (ort-cpu; adds one graph and "
                        "a copy of the weights on disk); every request, the single stream too, then runs on it, "
                        "so the folder gives one answer however it is called")
    b.add_argument("--batch-prefill", choices=("auto", "same", "rowwise", "rowwise-gqa"), default=None,
                   help="how the batched model runs prompt chunks: 'rowwise' (a second graph with int8 per-channel "
                        "weights, ONNX Runtime's int8 GEMM: ~2.7x faster prefill on CPUs with VNNI/AMX and, for an "
                        "int4 target, prompt K/V closer to fp32, for an int8 copy of the weights in memory), "
                        "'rowwise-gqa' (that graph attending with ONNX Runtime's fused GroupQueryAttention beside "
                        "a 'rows' step graph: faster long prompts; not with --hidden-layers) or 'same' (the "
                        "batched graph, quantized as the target: one copy of the weights); decode steps keep the "
                        "target's precision. Default 'auto': rowwise-gqa for int4 (rowwise with --hidden-layers), "
                        "same otherwise")
    b.add_argument("--batch-attention", choices=("gqa", "rows"), default=None,
                   help="the batched model's attention: 'rows' (plain ops over each call's used part of the "
                        "cache: a batch verifies several tokens per row, so it speculates) or 'gqa' "
                        "(GroupQueryAttention: on the CPU a batch then runs one token per row, no speculation, and "
                        "so does the single stream, which runs on the batched model too); default: rows for a gqa "
                        "target, else the target's attention")
    b.add_argument("--batch-block-size", type=int, default=None,
                   help="int8/int4 with --batch: the batched graph's quantization block, its LM head keeping "
                        "--block-size's (default: --block-size's). Larger blocks make steps cheaper and the model "
                        "less faithful to fp32; above 32 the runtime pads every batched call to an even number of "
                        "rows (docs/batching.md)")
    b.add_argument("--hidden-layers", type=_layer_list, default=None,
                   help="with --batch: the batched graphs also return these decoder layers' outputs, which a "
                        "draft head trained by `specrt train-draft` reads, e.g. 2,15,27 for SmolLM2")
    b.add_argument("--quiet", action="store_true", help="no progress bars (specrt's, transformers', Hugging Face's)")
    b.add_argument("--force", action="store_true",
                   help="replace --out even if it is not a previous specrt build (its contents are deleted)")
    b.set_defaults(fn=cmd_build)
    show_build_defaults(b)

    def sampling_args(s):
        s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
        s.add_argument("--top-k", type=int, default=0, help="sample from the K most likely tokens (0: all)")
        s.add_argument("--top-p", type=float, default=1.0,
                       help="sample from the smallest set of tokens with this much probability (1: all)")
        s.add_argument("--min-p", type=float, default=0.0,
                       help="drop tokens less likely than this fraction of the most likely one (0: none)")
        s.add_argument("--seed", type=int, default=None, help="seed of the sampler (default: a fresh one each run)")
        s.add_argument("--k", type=int, default=None, help="draft tokens per iteration (<= the built k)")
        s.add_argument("--threads", type=_positive_int, default=2, help="ONNX Runtime threads")
        s.add_argument("--max-new-tokens", type=_positive_int, default=128, help="tokens to generate at most")
        s.add_argument("--memory", choices=("fast", "shared"), default="fast",
                       help="fast: per-session pre-packed weights; shared: one copy of the weights, slower")

    g = sub.add_parser("generate", help="stream a completion")
    g.add_argument("engines", help="folder written by `specrt build`")
    g.add_argument("prompt")
    g.add_argument("--raw", action="store_true", help="do not apply the chat template")
    g.add_argument("--plain", action="store_true", help="plain decoding (no draft)")
    g.add_argument("--lookup", type=_positive_int, metavar="N",
                   help="prompt lookup instead of the draft model: propose what followed the latest earlier "
                        "match of the last N tokens (greedy only; works on engines built with --draft none)")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--json", action="store_true", help="print metrics as JSON")
    g.add_argument("--verify", choices=("full", "none"), default="full",
                   help="full (default): check every file's sha256 while loading; none: existence and size only")
    g.add_argument("--engine", choices=("auto", "one-row"), default="auto",
                   help="auto (default): a --batch folder runs the request on its batched model as a batch of "
                        "one, the engine its server runs (the same tokens); one-row: the folder's one-row graphs "
                        "(their answers may differ from the server's by rounding)")
    st = g.add_argument_group("structured output (exact under speculation; folders built with --batch)")
    st.add_argument("--json-schema", metavar="SCHEMA", help="a JSON schema (its text, or a file) the answer must match")
    st.add_argument("--regex", help="a regular expression the whole answer must match")
    st.add_argument("--choice", action="append", help="the answer is one of these strings (repeatable)")
    st.add_argument("--grammar", metavar="GRAMMAR", help="a Lark or GBNF grammar (its text, or a file)")
    sampling_args(g)
    g.add_argument("--head", metavar="DIR", help="a draft head from `specrt train-draft` as the draft (the folder "
                                                 "built with --batch --hidden-layers; the answer does not change)")
    g.set_defaults(fn=cmd_generate)

    be = sub.add_parser("bench", help="plain vs speculative on the same prompts, interleaved, in one run")
    be.add_argument("engines", nargs="+", help="one or more folders written by `specrt build` (e.g. fp32, int8 and "
                    "int4 targets): interleaved prompt by prompt in one run")
    be.add_argument("--prompts", type=_positive_int, default=8, help="how many built-in prompts")
    be.add_argument("--rounds", type=_positive_int, default=1, help="times each prompt is run")
    be.add_argument("--hf-reference", metavar="MODEL", help="also time Hugging Face generate on this model source")
    be.add_argument("--json", metavar="FILE", help="write the report as JSON")
    be.add_argument("--lookup", type=int, default=0, metavar="N",
                    help="also run greedy prompt lookup (no draft model) with N-gram matches, e.g. 1 or 2")
    sampling_args(be)
    be.set_defaults(fn=cmd_bench)

    pr = sub.add_parser("profile", help="ONNX Runtime's per-operator profile of one generation: table + trace")
    pr.add_argument("engines", help="folder written by `specrt build`")
    pr.add_argument("--out", default="profile", help="folder for trace.json and ops.csv")
    pr.add_argument("--prompt", default="Explain why the sky is blue.", help="the prompt generated from")
    pr.add_argument("--max-new-tokens", type=_positive_int, default=32, help="tokens to generate")
    pr.add_argument("--plain", action="store_true", help="profile plain decoding instead of speculative")
    pr.add_argument("--threads", type=_positive_int, default=2, help="ONNX Runtime threads")
    pr.add_argument("--top", type=_positive_int, default=8, help="operator types shown per graph")
    pr.set_defaults(fn=cmd_profile)

    i = sub.add_parser("inspect", help="print a manifest readably")
    i.add_argument("engines", help="folder written by `specrt build`")
    i.add_argument("--json", action="store_true", help="print the manifest as JSON")
    i.set_defaults(fn=cmd_inspect)

    q = sub.add_parser("quality", help="each engine folder against the fp32 reference on held-out prompts: "
                       "top-1 agreement, KL, max |delta logit|, greedy exact match, step costs")
    q.add_argument("engines", nargs="+", help="folders written by `specrt build`, each measured on the model its "
                   "requests run (a --batch folder's batched model); list the reference too for that row")
    q.add_argument("--reference", required=True, help="the fp32 engine folder, e.g. artifacts/smollm2")
    q.add_argument("--prompts", metavar="FILE", help=".jsonl (a \"prompt\" field) or one prompt per line; "
                   "its held-out part is used (default: the shipped calibration set)")
    q.add_argument("--eval", type=_positive_int, default=16, help="held-out prompts to measure on")
    q.add_argument("--new-tokens", type=_positive_int, default=32, help="greedy tokens per prompt")
    q.add_argument("--threads", type=_positive_int, default=2, help="ONNX Runtime threads")
    q.add_argument("--json", metavar="FILE", help="write the report as JSON")
    q.add_argument("--record", action="store_true", help="write each folder's row into its manifest.json "
                   "(`quality`, with the reference and prompts), where `specrt inspect` shows it")
    q.set_defaults(fn=cmd_quality)

    cm = sub.add_parser("check-modes", help="one engine folder through every way of calling it (generate, the "
                        "Python API, threads, open_batch, the server, the Triton model): greedy and a seeded sample "
                        "equal to plain decoding? Exit 1 when any differ")
    cm.add_argument("engines", help="folder written by `specrt build`")
    cm.add_argument("--prompts", type=_positive_int, default=12, help="held-out prompts to check")
    cm.add_argument("--prompt-file", metavar="FILE", help=".jsonl (a \"prompt\" field) or one prompt per line; "
                    "its held-out part is used (default: the shipped calibration set)")
    cm.add_argument("--max-new-tokens", type=_positive_int, default=64, help="tokens per answer at most")
    cm.add_argument("--rows", type=_row_counts, default="1,8", metavar="R,R",
                    help="batched modes (open_batch, server --max-num-seqs, Triton max_num_seqs) at these row counts")
    cm.add_argument("--temperature", type=float, default=0.8, help="temperature of the seeded sample")
    cm.add_argument("--seed", type=int, default=7, help="seed of the seeded sample")
    cm.add_argument("--threads", type=_positive_int, default=2, help="ONNX Runtime threads per engine")
    cm.add_argument("--json", metavar="FILE", help="write the report as JSON")
    cm.set_defaults(fn=cmd_check_modes)

    rt = sub.add_parser("retime", help="time a built folder's steps again on this machine and write the costs "
                        "that choose speculation into its manifest (a build timed on a busy or another machine "
                        "chooses badly)")
    rt.add_argument("engines", help="folder written by `specrt build` (ONNX Runtime CPU)")
    rt.add_argument("--gates-only", action="store_true",
                    help="measure the exactness gates on this machine and add it to the folder's machines, keeping "
                         "the costs (another kind of CPU the folder also serves on)")
    rt.set_defaults(fn=cmd_retime)

    sv = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    sv.add_argument("engines", help="folder written by `specrt build`")
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    sv.add_argument("--port", type=int, default=8000, help="0: any free port (printed at start)")
    sv.add_argument("--workers", type=int, default=1, help="copies of the engine, each with its own weights")
    sv.add_argument("--max-num-seqs", type=int, metavar="N",
                    help="rows of each copy: up to N requests decoding at once on one copy of the weights (engines "
                         "built with `specrt build --batch`; default 1)")
    sv.add_argument("--queue-size", type=int, default=8, help="requests that may wait for a row (then 429)")
    sv.add_argument("--prefill-budget", type=int, metavar="TOKENS",
                    help="an engine step goes on prefilling, chunk after chunk and request after request, until "
                         "it has fed this many prompt tokens (it may pass it by less than a chunk; default: one "
                         "chunk a step): requests that arrive together start sooner, running ones wait longer "
                         "for that step; answers do not change")
    sv.add_argument("--head", metavar="DIR",
                    help="a draft head from `specrt train-draft`: it drafts inside every batch where its measured "
                         "cost pays (the folder built with --hidden-layers; answers do not change)")
    sv.add_argument("--timeout", type=float, default=300.0, help="seconds per request, queueing included")
    sv.add_argument("--memory", choices=("fast", "shared"), default="fast",
                    help="fast: per-session pre-packed weights; shared: one copy of the prefill weights, slower")
    sv.add_argument("--threads", type=int, default=2, help="ONNX Runtime threads (one pool for the process)")
    sv.add_argument("--model-name", "--served-model-name", dest="model_name",
                    help="the model id clients send (default: the engine folder's name); --served-model-name is "
                         "vLLM's name for it")
    sv.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every route but /health (default: "
                    "the SPECRT_API_KEY environment variable, which other users cannot read in the process list)")
    sv.add_argument("--allowed-hosts", default="", metavar="NAMES",
                    help="Host header names to accept besides the bound address and localhost names, comma-separated "
                         "('*.example.com' matches subdomains, '*' any host): others get 400 (DNS rebinding)")
    sv.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                    help="a browser origin allowed to call the API, e.g. http://localhost:3000 (repeatable; '*' any); "
                         "default: no CORS headers, so browsers refuse cross-origin calls")
    sv.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    sv.add_argument("--read-timeout", type=float, default=15.0,
                    help="seconds a client has to send a whole request, headers and body")
    sv.add_argument("--keep-alive", type=int, default=5, help="seconds an idle connection stays open")
    sv.add_argument("--max-connections", type=int, default=64,
                    help="connections and requests at once; more get 503")
    sv.set_defaults(fn=cmd_serve)

    tr = sub.add_parser("triton-repo", help="write a Triton Inference Server model repository (Python backend)")
    tr.add_argument("engines", help="folder written by `specrt build`")
    tr.add_argument("out", help="model repository folder to write (created)")
    tr.add_argument("--model-name", help="Triton model name (default: the engine folder's name)")
    tr.add_argument("--instances", type=int, default=1, help="model instances (each loads its own engines)")
    tr.add_argument("--memory", choices=("fast", "shared"), default="fast",
                    help="fast: per-session pre-packed weights; shared: one copy of the prefill weights, slower")
    tr.add_argument("--max-num-seqs", type=int, metavar="N", help="one batched engine per instance decodes up to N "
                    "requests at once (engines built with `specrt build --batch`; --instances 1 is then right)")
    tr.add_argument("--queue-size", type=int, default=8, help="requests that may wait for a row of an instance")
    tr.add_argument("--copy-engines", action="store_true",
                    help="copy the engines into the repository (default: refer to their absolute path)")
    tr.add_argument("--force", action="store_true",
                    help="overwrite a model folder that triton-repo did not write (its config.pbtxt, 1/model.py "
                         "and, with --copy-engines, its engines/ folder)")
    tr.set_defaults(fn=cmd_triton_repo)

    qd = sub.add_parser("qdq", help="an engine folder whose target is a calibrated static INT8 Q/DQ copy (TensorRT's "
                                    "form, rules-checked) of an fp32 folder's target, with its tokenizer and draft")
    qd.add_argument("engines", help="fp32 folder written by `specrt build`")
    qd.add_argument("--out", required=True, help="engine folder to write (new, or a previous specrt folder, replaced)")
    qd.add_argument("--force", action="store_true",
                    help="replace --out even if it is not a specrt folder (everything in it is deleted)")
    qd.add_argument("--prompts", type=_positive_int, default=16, help="calibration prompts")
    qd.add_argument("--eval-prompts", type=_positive_int, default=8, help="held-out prompts for parity")
    qd.add_argument("--decode-steps", type=_positive_int, default=16, help="greedy steps per prompt")
    qd.add_argument("--keep-float", metavar="SUFFIXES",
                    help="weight-name suffixes whose MatMuls stay float, comma-separated ('' = quantize all; "
                         "default: see `specrt.calibration.qdq.QDQSpec`)")
    qd.add_argument("--threads", type=_positive_int, default=None, help="ONNX Runtime threads (default: all cores)")
    qd.add_argument("--json", action="store_true", help="print the manifest")
    qd.add_argument("--quiet", action="store_true", help="no progress lines")
    qd.set_defaults(fn=cmd_qdq)

    from specrt.heads.cli import add_parser as add_train_draft
    add_train_draft(sub, _positive_int)
    return p


def main(argv=None) -> int:
    p = make_parser()
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO if a.verbose else logging.WARNING, format="%(levelname)s %(message)s")
    try:
        return a.fn(a)
    except SpecrtError as e:
        print(f"specrt: error: {type(e).__name__}: {in_flag_words(str(e), p.commands.choices[a.cmd])}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # the reader went away (`specrt generate ... | head`): stop quietly, no traceback
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except Exception as e:  # a failure specrt did not foresee: one line, the traceback only with -v
        if a.verbose:
            raise
        print(f"specrt: error: unexpected {type(e).__name__}: {e} (run with -v for the traceback, and please "
              "report it)", file=sys.stderr)
        return 1


class _Parser(argparse.ArgumentParser):
    """Usage mistakes are one `specrt: error:` line (exit 2), like every other error."""

    def __init__(self, *args, **kw):
        kw.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kw)

    def error(self, message):
        self.exit(2, f"specrt: error: {self.prog.removeprefix('specrt').strip() or 'usage'}: {message} "
                     f"(see `{self.prog} --help`)\n")


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v} must be >= 1")
    return v


def _layer_list(text: str) -> tuple[int, ...]:
    from specrt.heads.cli import _layers
    return _layers(text)


def _row_counts(text: str) -> tuple[int, ...]:
    try:
        rows = tuple(int(r) for r in text.split(",") if r.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of row counts, e.g. 1,8") from None
    if not rows or any(not 1 <= r <= 256 for r in rows):
        raise argparse.ArgumentTypeError(f"{text!r}: give row counts in [1, 256], e.g. 1,8")
    return rows


if __name__ == "__main__":
    sys.exit(main())
