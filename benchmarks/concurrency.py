"""Many requests at once: specrt's server against the peers' ways of batching, clients 1-16.

    make bench-concurrency                        # venvs, peer models, llama-server, then the sweep
    .venv/bin/python benchmarks/concurrency.py [--systems a,b] [--clients 1,8] [--prompts 4] [--json F] [--rounds 3]
        [--specrt-serve-args '--workers 1 --queue-size 64'] [--specrt-serve-args-alt '--max-num-seqs {clients}']
        [--specrt-checkout-alt /tmp/old] [--specrt-engines-alt /tmp/old/artifacts/smollm2-int4]
    .venv/bin/python benchmarks/concurrency.py --list

The same requests for every system: the first --prompts held-out prompts of
specrt/calibration/data/prompts.jsonl (as `specrt quality` takes them), chat-templated by
specrt's tokenizer, each sent twice (24 requests by default), as token ids, greedy, at most
--max-new-tokens new tokens, an EOS stops. At each concurrency level N, N clients each send
their next request when their previous one ends:

    specrt-*        `specrt serve ENGINES ARGS` (ARGS = --specrt-serve-args; `{clients}` in it is
                    replaced by N and the server restarted per level), streamed /v1/completions
    specrt-*-stream today's single-stream runtime in-process, one request at a time (1 client only)
    genai-*         onnxruntime-genai's batch API: static batches of N, each runs until its longest
                    member ends (what its users do)
    llama-*         llama.cpp's `llama-server -np N` (continuous batching), streamed /v1/completions
    openvino-int4   OpenVINO GenAI's ContinuousBatchingPipeline, max_num_seqs N, prefix caching off

Each system lives in its own long-lived process (a server, or a worker in its own venv); start,
restart and warm-up are not measured. Systems run one after another, in an order rotated at
each level, so drift on a shared machine hits them alike. A system's "alone" answers are its
answers at 1 client (the first copy of each prompt; the second copy is then compared with it);
without level 1 in --clients, every system first serves each distinct prompt alone.

    agg tok/s   all requests' output tokens / wall time from the first submission to the last token
    TTFT        first streamed chunk (token) - submission (a static batch's requests are submitted
                when the batch starts)
    ITL         gaps between consecutive chunks of a request (speculation sends bursts)
    TPOT        a request's (last - first chunk time) / (tokens - 1)
    = alone     requests whose answer equals the same system's answer to the same prompt alone
                (text for servers, token ids in-process): batch invariance
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).with_name("peers")))
from common import GGUF, PEERS_CACHE, PEERS_PYTHON, ROOT, eval_prompts  # noqa: E402
from load_stats import level_stats, print_level, print_summary  # noqa: E402

OPENVINO_PYTHON = ROOT / ".venv-openvino/bin/python"
LLAMA_SERVER = PEERS_CACHE / "llama-server"
DEFAULT_SERVE_ARGS = "--workers 1 --queue-size 64"


@dataclass(frozen=True)
class System:
    name: str
    label: str
    kind: str            # specrt-server | specrt-stream | genai | llama | openvino
    path: Path           # engine folder, model folder or GGUF
    needs: tuple = ()    # other files it cannot run without (a venv's python, a binary)
    only_clients: int | None = None   # runs at this level only (the single-stream reference)

    @property
    def missing(self) -> str | None:
        how = {"specrt-server": "make engines engines-int4 (engines-int8row, engines-int8row-gqa, engines-int4-same, -gqa, -b64, -b128)", "specrt-stream": "make engines engines-int4",
               "specrt-batch": "make engines-int4 (engines-int8row, engines-int8row-gqa, engines-int4-b128)",
               "genai": "make venv-peers && .venv/bin/python benchmarks/run_peers.py build",
               "llama": "make llama-server (and benchmarks/run_peers.py build for the F32 GGUF)",
               "openvino": "make venv-openvino && .venv/bin/python benchmarks/run_peers.py build"}[self.kind]
        for p in (self.path, *self.needs):
            if not p.exists():
                return f"{p} does not exist: run `{how}`"
        return None


SYSTEMS = {s.name: s for s in [
    System("specrt-fp32", "specrt serve fp32 (int8 self-draft)", "specrt-server", ROOT / "artifacts/smollm2"),
    System("specrt-int4", "specrt serve int4", "specrt-server", ROOT / "artifacts/smollm2-int4"),
    System("specrt-fp32-alt", "specrt serve fp32, alt args", "specrt-server", ROOT / "artifacts/smollm2"),
    System("specrt-int4-alt", "specrt serve int4, alt args", "specrt-server", ROOT / "artifacts/smollm2-int4"),
    # int4 prompt chunks too (`--batch-prefill same`, one copy of the weights; the int4 default
    # runs them through an int8 graph): make engines-int4-same
    System("specrt-int4same-alt", "specrt serve int4, int4 prefill, alt args", "specrt-server",
           ROOT / "artifacts/smollm2-int4-same"),
    # int4, the int8 prompt graph attending as the step graph does (`--batch-prefill rowwise`; the
    # int4 default's attends with GroupQueryAttention): make engines-int4-rowwise
    System("specrt-int4rowwise-alt", "specrt serve int4, rows prompt graph, alt args", "specrt-server",
           ROOT / "artifacts/smollm2-int4-rowwise"),
    # int4, the batched model with --batch-attention gqa (plain one-token steps): make engines-int4-gqa
    System("specrt-int4gqa-alt", "specrt serve int4, gqa attention, alt args", "specrt-server",
           ROOT / "artifacts/smollm2-int4-gqa"),
    # int4, the batched graph in blocks of 64 / 128 (`--batch-block-size`, calls padded to even rows):
    # make engines-int4-b64 / engines-int4-b128
    System("specrt-int4b64-alt", "specrt serve int4, batched block 64, alt args", "specrt-server",
           ROOT / "artifacts/smollm2-int4-b64"),
    System("specrt-int4b128-alt", "specrt serve int4, batched block 128, alt args", "specrt-server",
           ROOT / "artifacts/smollm2-int4-b128"),
    # the same batched engines in process (open_batch in a worker, no server): as genai and OpenVINO run
    System("specrt-int8row", "specrt serve int8row (int8 per channel, ONNX Runtime's int8 GEMM)", "specrt-server",
           ROOT / "artifacts/smollm2-int8row"),
    System("specrt-int8row-alt", "specrt serve int8row, alt args", "specrt-server", ROOT / "artifacts/smollm2-int8row"),
    # int8row, the batched model with --batch-attention gqa (plain one-token steps; on AVX-512 VNNI
    # its steps cost x0.84-0.89 of the rows graph's, docs/benchmarks.md): make engines-int8row-gqa
    System("specrt-int8rowgqa", "specrt serve int8row, gqa attention", "specrt-server",
           ROOT / "artifacts/smollm2-int8row-gqa"),
    System("specrt-int4-inproc", "specrt int4 batched, in process", "specrt-batch", ROOT / "artifacts/smollm2-int4"),
    System("specrt-int8row-inproc", "specrt int8row batched, in process", "specrt-batch",
           ROOT / "artifacts/smollm2-int8row"),
    System("specrt-int8rowgqa-inproc", "specrt int8row gqa attention batched, in process", "specrt-batch",
           ROOT / "artifacts/smollm2-int8row-gqa"),
    System("specrt-int4b128-inproc", "specrt int4 batched block 128, in process", "specrt-batch",
           ROOT / "artifacts/smollm2-int4-b128"),
    System("specrt-fp32-stream", "specrt fp32 single stream", "specrt-stream", ROOT / "artifacts/smollm2",
           only_clients=1),
    System("specrt-int4-stream", "specrt int4 single stream", "specrt-stream", ROOT / "artifacts/smollm2-int4",
           only_clients=1),
    System("genai-int4", "onnxruntime-genai int4 static batches", "genai", PEERS_CACHE / "genai-int4",
           (PEERS_PYTHON,)),
    System("genai-fp32", "onnxruntime-genai fp32 static batches", "genai", PEERS_CACHE / "genai-fp32",
           (PEERS_PYTHON,)),
    System("llama-q4_1", "llama-server -np N Q4_1", "llama", GGUF, (LLAMA_SERVER,)),
    System("llama-f32", "llama-server -np N F32", "llama", PEERS_CACHE / "llama-f32.gguf", (LLAMA_SERVER,)),
    System("openvino-int4", "OpenVINO GenAI int4 continuous batching", "openvino", PEERS_CACHE / "openvino-int4",
           (OPENVINO_PYTHON,)),
]}
DEFAULT = [n for n in SYSTEMS if not n.endswith("-alt")]


def pick(names: str | None, alt: bool) -> list[System]:
    wanted = [n.strip() for n in names.split(",") if n.strip()] if names else \
        DEFAULT + ([n for n in SYSTEMS if n.endswith("-alt")] if alt else [])
    unknown = [n for n in wanted if n not in SYSTEMS]
    if unknown:
        raise SystemExit(f"unknown system(s) {unknown}: choose from {', '.join(SYSTEMS)}")
    out = []
    for n in wanted:
        why = SYSTEMS[n].missing
        if why and names:                           # asked for by name: it must run
            raise SystemExit(f"{n}: {why}")
        if why:
            print(f"skipped {n}: {why}")
        else:
            out.append(SYSTEMS[n])
    return out


def make_runner(s: System, a, log_dir: Path):
    from runners import GenaiBatches, LlamaServer, OpenVINOBatching, SpecrtBatched, SpecrtServer, SpecrtStream
    if s.kind == "specrt-server":
        alt = s.name.endswith("-alt")
        path = Path(a.specrt_engines_alt) if alt and a.specrt_engines_alt else s.path
        return SpecrtServer(s.name, path, a.specrt_serve_args_alt if alt else a.specrt_serve_args,
                            a.threads, log_dir, checkout=a.specrt_checkout_alt if alt else None)
    return {"specrt-stream": lambda: SpecrtStream(s.name, s.path, a.threads),
            "specrt-batch": lambda: SpecrtBatched(s.name, s.path, a.threads),
            "genai": lambda: GenaiBatches(s.name, s.path, PEERS_PYTHON, a.threads),
            "llama": lambda: LlamaServer(s.name, LLAMA_SERVER, s.path, a.threads, log_dir),
            "openvino": lambda: OpenVINOBatching(s.name, s.path, OPENVINO_PYTHON, a.threads)}[s.kind]()


def requests(a) -> tuple[list[list[int]], list[int], list[str]]:
    """The prompts' chat-templated ids (as SpeculativeGenerator.encode_prompt(chat=True)), the EOS ids."""
    from specrt import manifest as mf
    from specrt.runtime.tokenizer import Tokenizer
    eng = ROOT / "artifacts/smollm2"
    tok = Tokenizer(eng, mf.load(eng).tokenizer)
    prompts = eval_prompts(a.prompts, a.prompt_file)
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": p.text}]), add_special_tokens=False)
           for p in prompts]
    return ids, sorted(tok.eos_token_ids), [p.id for p in prompts]


def rotate(xs: list, k: int) -> list:
    k %= len(xs)
    return xs[k:] + xs[:k]


def sweep(a) -> dict:
    systems = pick(a.systems, bool(a.specrt_serve_args_alt))
    levels = sorted({int(c) for c in a.clients.split(",")})    # 1 first: its answers are the "alone" ones
    distinct, eos, prompt_ids = requests(a)
    if a.ignore_eos:        # the runners read no EOS ids as "generate through EOS" (runners.py)
        eos = []
    reqs = distinct * a.repeat                      # 24 requests: the prompts, then the prompts again
    log_dir = Path(a.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    report = {"prompts": prompt_ids, "requests": len(reqs), "max_new_tokens": a.max_new_tokens, "ignore_eos": a.ignore_eos,
              "threads": a.threads, "levels": levels, "specrt_serve_args": a.specrt_serve_args,
              "specrt_serve_args_alt": a.specrt_serve_args_alt, "loadavg_start": os.getloadavg(),
              "systems": {s.name: {"label": s.label, "kind": s.kind, "path": str(s.path)} for s in systems},
              "alone": {}, "results": {}}
    print(f"{len(systems)} systems, {len(reqs)} requests ({len(distinct)} held-out prompts x {a.repeat}, "
          f"{sum(map(len, distinct))} prompt tokens each round), <= {a.max_new_tokens} new tokens, greedy, "
          f"{a.threads} threads, clients {levels} | load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores",
          flush=True)
    runners = {}
    try:
        for s in systems:
            print(f"starting {s.name}", flush=True)
            t0 = time.perf_counter()
            runners[s.name] = make_runner(s, a, log_dir)
            report["systems"][s.name]["start_s"] = round(time.perf_counter() - t0, 1)
            if hasattr(runners[s.name], "worker"):
                report["systems"][s.name]["info"] = runners[s.name].worker.info
        if 1 not in levels:                         # each distinct prompt alone: the reference answers
            for s in systems:
                runners[s.name].prepare(1)
                recs, _ = runners[s.name].run(distinct, 1, a.max_new_tokens, eos)
                report["alone"][s.name] = [x["answer"] for x in recs]
                print(f"alone: {s.name} done", flush=True)
        for li, n in enumerate(levels):
            runs: dict[str, list] = {}
            # --rounds R: every system R times at this level, in a rotated order each round, so a
            # slow minute of the shared machine lands on different systems; the table shows
            # each system's median round
            for rnd in range(a.rounds):
                for s in rotate(systems, li + rnd):
                    if s.only_clients not in (None, n):
                        continue
                    r = runners[s.name]
                    r.prepare(n)
                    load = os.getloadavg()[0]
                    recs, extra = r.run(reqs, n, a.max_new_tokens, eos)
                    if n == 1 and s.name not in report["alone"]:   # 1 client: each request alone
                        report["alone"][s.name] = [x["answer"] for x in recs[:len(distinct)]]
                    alone = report["alone"][s.name]
                    st = level_stats(recs, [alone[i % len(distinct)] for i in range(len(reqs))])
                    st |= {"system": s.name, "label": s.label, "loadavg": load, **extra}
                    runs.setdefault(s.name, []).append(st | {"records": recs})
                    print(f"  {n} clients{f' round {rnd}' if a.rounds > 1 else ''}: {s.name} "
                          f"{st['agg_tok_s']:.1f} tok/s, = alone {st['equal_alone']}/{st['requests']}", flush=True)
            rows = []
            for name, sts in runs.items():
                by_speed = sorted(sts, key=lambda x: x["agg_tok_s"])
                st = dict(by_speed[(len(by_speed) - 1) // 2])          # the median round (the lower of two)
                st["rounds_agg_tok_s"] = [x["agg_tok_s"] for x in sts]
                st["equal_alone"] = min(x["equal_alone"] for x in sts)  # the worst round
                report["results"].setdefault(str(n), {})[name] = st
                rows.append(st)
            print_level(n, rows, list(SYSTEMS))
            if a.rounds > 1:
                for st in rows:
                    print(f"  {st['system']} rounds: " + ", ".join(f"{x:.1f}" for x in st["rounds_agg_tok_s"]))
    finally:
        for r in runners.values():
            r.close()
    report["loadavg_end"] = os.getloadavg()
    report["summary"] = print_summary(report)
    return report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--systems", help=f"comma-separated (default: all built but the -alt ones): {','.join(SYSTEMS)}")
    ap.add_argument("--clients", default="1,2,4,8,16", help="concurrency levels")
    ap.add_argument("--prompts", type=int, default=12, help="distinct held-out prompts")
    ap.add_argument("--repeat", type=int, default=2, help="each prompt is sent this many times per level")
    ap.add_argument("--rounds", type=int, default=1,
                    help="run every system this many times per level (rotated order) and report its median round")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--ignore-eos", action="store_true",
                    help="every request runs --max-new-tokens tokens (no system stops at EOS): the same work for "
                         "every system, whose answers otherwise differ in length with their quantization")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--specrt-serve-args", default=DEFAULT_SERVE_ARGS,
                    help="`specrt serve` options for specrt-fp32/-int4; {clients} = the level's clients "
                         "(then restarted per level), e.g. '--max-num-seqs {clients} --queue-size 64'")
    ap.add_argument("--specrt-serve-args-alt", default="",
                    help="a second server command line, run as specrt-fp32-alt/-int4-alt in the same sweep")
    ap.add_argument("--specrt-checkout-alt", default=None,
                    help="run the -alt servers from this checkout of specrt (its PYTHONPATH), e.g. an older commit "
                         "from `git archive REV | tar -x -C /tmp/old`: the same engines, two versions, one sweep")
    ap.add_argument("--specrt-engines-alt", default=None,
                    help="the -alt servers' engine folder (default: the same as the system without -alt), e.g. "
                         "the folder the older checkout built, when it cannot load today's")
    ap.add_argument("--prompt-file", help="a .jsonl or text prompt file (default: the shipped prompts.jsonl)")
    ap.add_argument("--log-dir", default=str(ROOT / ".cache/peers/logs"), help="the servers' output")
    ap.add_argument("--json", help="write everything (per-request times and answers included) here")
    ap.add_argument("--list", action="store_true", help="the systems and whether each is ready")
    a = ap.parse_args(argv)
    if a.list:
        for s in SYSTEMS.values():
            print(f"{s.name:<20} {s.label:<45} {s.missing or 'ready'}")
        return 0
    t0 = time.perf_counter()
    report = sweep(a)
    print(f"(took {time.perf_counter() - t0:.0f} s, starting the systems included)")
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
