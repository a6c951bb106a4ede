"""One engine folder, every way a user can call it: the same answer? (`specrt check-modes`)

For each prompt (chat template applied, as `specrt generate` does) and two settings, greedy
and one seeded sample, the folder answers through

    generate: plain (reference)   SpeculativeGenerator(folder), method="plain": the target's own
                                  plain decoding; every other mode is compared to it
    generate: default             the same generator, speculative (plain when the folder has no draft)
    specrt generate               SpeculativeGenerator(folder, methods=(method,)), as the CLI opens it
    api: N threads                N threads, each with its own SpeculativeGenerator
    server: one-request           the OpenAI app (`specrt serve`'s build_app), POST /v1/completions
    triton: one-request           TritonPythonModel (serve/triton_model.py) with a stand-in
                                  triton_python_backend_utils
  and, where the folder has a batched model (manifest `batch`), for each row count R:
    open_batch R: alone / generate_batch / threads
    server: --max-num-seqs R      triton: max_num_seqs R
  and, at the largest R, every prompt at once on an engine that prefills up to 1024 prompt
  tokens a step (`--prefill-budget`: several requests join in one step):
    open_batch R, prefill budget 1024: generate_batch

Tokens are compared where a mode returns them; the server and the Triton model return text
only, so their text is compared to the reference's text. Every mode stops at EOS, as it does
for a user (the Triton model has no ignore_eos input). Imports the runtime and serve only
(no torch): it runs wherever the engines run.
"""
from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np

from specrt import manifest as mf
from specrt.errors import ConfigError, SpecrtError
from specrt.runtime.sampling import SamplingParams

REFERENCE = "generate: plain (reference)"
SETTINGS = ("greedy", "sample")


@dataclass(frozen=True)
class Case:
    """One prompt: as typed (the Triton model encodes it itself) and as token ids."""
    text: str
    ids: tuple[int, ...]        # chat template applied
    index: int = 0              # in the prompts given (those that do not fit are left out)


@dataclass(frozen=True)
class Answer:
    tokens: tuple[int, ...] | None     # None: the mode returns text only
    text: str


# a family opens one engine and yields (mode name, answers[setting][case]) for each of its modes
Run = Callable[[list[Case], "Job"], Iterator[tuple[str, list[list[Answer]]]]]


@dataclass(frozen=True)
class Family:
    names: tuple[str, ...]
    run: Run | None             # None: does not apply to this folder (why_not says why)
    why_not: str = ""


@dataclass(frozen=True)
class Job:
    engines: Path
    max_new_tokens: int
    settings: tuple[SamplingParams, SamplingParams]     # greedy, seeded sample
    threads: int                                        # ONNX Runtime threads per engine


# --- the modes -----------------------------------------------------------------------------
def _answer(chunks) -> Answer:
    toks, text = [], []
    for c in chunks:
        toks += c.tokens
        text.append(c.text)
    return Answer(tuple(toks), "".join(text))


def _completion(c) -> Answer:
    return Answer(tuple(c.tokens), c.text)


def _default_method(engines: Path) -> str:
    """What `specrt generate` runs without --plain or --lookup; stream()'s default is
    "speculative" whether or not the folder has a draft, so a folder without one needs "plain"."""
    return "speculative" if mf.load(engines).draft is not None else "plain"


def _api(cases: list[Case], job: Job):
    from specrt.runtime import SpeculativeGenerator
    gen = SpeculativeGenerator(job.engines, threads=job.threads)
    for name, method in ((REFERENCE, "plain"), ("generate: default", _default_method(job.engines))):
        yield name, [[_answer(gen.stream(list(c.ids), max_new_tokens=job.max_new_tokens, sampling=s, method=method))
                      for c in cases] for s in job.settings]


def _cli(cases: list[Case], job: Job):
    from specrt.runtime import SpeculativeGenerator
    method = _default_method(job.engines)
    gen = SpeculativeGenerator(job.engines, threads=job.threads, methods=(method,))      # as cmd_generate
    yield "specrt generate", [[_answer(gen.stream(list(c.ids), max_new_tokens=job.max_new_tokens, sampling=s,
                                                  method=method)) for c in cases] for s in job.settings]


def _threaded(n: int):
    def run(cases: list[Case], job: Job):
        from specrt.runtime import SpeculativeGenerator
        gens = [SpeculativeGenerator(job.engines, threads=job.threads) for _ in range(n)]
        method = _default_method(job.engines)

        def work(i: int, s: SamplingParams) -> dict[int, Answer]:      # thread i: cases i, i+n, ...
            return {j: _answer(gens[i].stream(list(cases[j].ids), max_new_tokens=job.max_new_tokens, sampling=s,
                                              method=method)) for j in range(i, len(cases), n)}
        out = []
        with ThreadPoolExecutor(n) as pool:
            for s in job.settings:
                got = {}
                for f in [pool.submit(work, i, s) for i in range(n)]:
                    got |= f.result()
                out.append([got[j] for j in range(len(cases))])
        yield f"api: {n} threads", out
    return run


def _batched(rows: int):
    def run(cases: list[Case], job: Job):
        from specrt.runtime.batch.generator import open_batch
        gen = open_batch(job.engines, max_num_seqs=rows, threads=job.threads)
        n = job.max_new_tokens
        try:
            yield f"open_batch {rows}: alone", [[_completion(gen.generate(list(c.ids), max_new_tokens=n, sampling=s))
                                                for c in cases] for s in job.settings]
            yield f"open_batch {rows}: generate_batch", [
                [_completion(c) for c in gen.generate_batch([list(c.ids) for c in cases], max_new_tokens=n,
                                                            sampling=s)] for s in job.settings]
            with ThreadPoolExecutor(len(cases)) as pool:
                yield f"open_batch {rows}: threads", [
                    [_completion(f.result()) for f in [pool.submit(gen.generate, list(c.ids), max_new_tokens=n,
                                                                   sampling=s) for c in cases]]
                    for s in job.settings]
        finally:
            gen.close()
    return run


def _budgeted(rows: int, budget: int = 1024):
    def run(cases: list[Case], job: Job):
        from specrt.runtime.batch.generator import open_batch
        gen = open_batch(job.engines, max_num_seqs=rows, threads=job.threads, prefill_budget=budget)
        try:
            yield f"open_batch {rows}, prefill budget {budget}: generate_batch", [
                [_completion(c) for c in gen.generate_batch([list(c.ids) for c in cases],
                                                            max_new_tokens=job.max_new_tokens, sampling=s)]
                for s in job.settings]
        finally:
            gen.close()
    return run


def _server(rows: int | None):
    def run(cases: list[Case], job: Job):
        from specrt.serve.server import ServeConfig, build_app
        # every prompt is sent at once: all of them may wait, and the last waits for the others
        cfg = ServeConfig(str(job.engines), max_num_seqs=rows, queue_size=len(cases), threads=job.threads,
                          timeout=24 * 3600.0)
        app, pool = build_app(cfg)
        pool.start()
        try:
            out = []
            for s in job.settings:
                bodies = [{"prompt": list(c.ids), "max_tokens": job.max_new_tokens, "temperature": s.temperature}
                          | ({} if s.seed is None else {"seed": s.seed}) for c in cases]
                out.append([Answer(None, body["choices"][0]["text"])
                            for body in asyncio.run(_post_all(app, "/v1/completions", bodies))])
        finally:
            pool.close()
        yield "server: one-request" if rows is None else f"server: --max-num-seqs {rows}", out
    return run


async def _post_all(app, path: str, bodies: list[dict]) -> list[dict]:
    return list(await asyncio.gather(*(_post(app, path, b) for b in bodies)))


async def _post(app, path: str, body: dict) -> dict:
    """One POST through the ASGI app (its guards included), as an HTTP server hands it over;
    the JSON answer, or a SpecrtError with the server's refusal."""
    raw = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json"),
                         (b"content-length", str(len(raw)).encode())],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 8000)}
    answered, sent, status, parts = asyncio.Event(), [], [0], []

    async def receive():
        if not sent:
            sent.append(True)
            return {"type": "http.request", "body": raw, "more_body": False}
        await answered.wait()       # the client stays until the answer is complete
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.start":
            status[0] = message["status"]
        elif message["type"] == "http.response.body":
            parts.append(message.get("body", b""))
            if not message.get("more_body"):
                answered.set()
    await app(scope, receive, send)
    text = b"".join(parts).decode()
    if status[0] != 200:
        raise SpecrtError(f"the server answered {status[0]} to {path}: {text[:300]}")
    return json.loads(text)


def _triton(rows: int | None):
    def run(cases: list[Case], job: Job):
        from specrt.serve import triton_model as tm
        # every prompt is sent at once: all of them may wait for a row
        params = {"engines": str(job.engines.resolve()), "queue_size": str(len(cases))}
        if rows is not None:
            params |= {"max_num_seqs": str(rows)}
        with _stand_in(tm):
            model = tm.TritonPythonModel()
            model.initialize({"model_config": json.dumps({"parameters": {k: {"string_value": v}
                                                                         for k, v in params.items()}}),
                              "model_repository": str(job.engines.resolve().parent), "model_instance_kind": "CPU"})
            try:
                out = []
                for s in job.settings:
                    # the config's types: max_tokens INT32, temperature FP32, seed INT64, chat BOOL
                    reqs = [_TritonRequest(text_input=np.array([c.text.encode()], dtype=object),
                                           max_tokens=np.array([job.max_new_tokens], np.int32),
                                           temperature=np.array([s.temperature], np.float32), chat=np.array([True]),
                                           **({} if s.seed is None else {"seed": np.array([s.seed], np.int64)}))
                            for c in cases]
                    model.execute(reqs)     # returns at once: the engine thread answers
                    out.append([Answer(None, r.text()) for r in reqs])
            finally:
                model.finalize()
        yield "triton: one-request" if rows is None else f"triton: max_num_seqs {rows}", out
    return run


# --- a stand-in for Triton's triton_python_backend_utils: the calls triton_model.py makes ----
class _Tensor:
    def __init__(self, name: str, array: np.ndarray):
        self._name, self._array = name, array

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray:
        return self._array


class _TritonError:
    INTERNAL, INVALID_ARG, UNAVAILABLE, CANCELLED = 2, 4, 5, 7

    def __init__(self, message: str, code: int | None = None):
        self._message = message

    def message(self) -> str:
        return self._message


class _Response:
    def __init__(self, output_tensors=None, error=None):
        self.output_tensors, self.error = output_tensors or [], error


class _TritonRequest:
    def __init__(self, **inputs):
        self.inputs = {k: _Tensor(k, v) for k, v in inputs.items()}
        self.sent: list[_Response] = []
        self.final = threading.Event()

    def get_response_sender(self):
        return self

    def is_cancelled(self) -> bool:
        return False

    def send(self, response=None, flags: int = 0) -> None:       # the response sender's send
        self.sent.append(response)
        if flags & 1:
            self.final.set()

    def text(self) -> str:
        self.final.wait()
        for r in self.sent:
            if r.error is not None:
                raise SpecrtError(f"the Triton model answered an error: {r.error.message()}")
        return "".join(t.as_numpy()[0].decode() for r in self.sent for t in r.output_tensors
                       if t.name() == "text_output")


class _StandIn:
    Tensor, TritonError, InferenceResponse = _Tensor, _TritonError, _Response
    TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1

    @staticmethod
    def get_input_tensor_by_name(request, name):
        return request.inputs.get(name)


@contextmanager
def _stand_in(tm):
    """triton_model.py's pb_utils for the duration (inside Triton the real one stays)."""
    before = tm.pb_utils
    tm.pb_utils = before or _StandIn
    try:
        yield
    finally:
        tm.pb_utils = before


# --- the check -----------------------------------------------------------------------------
def plan(engines: str | Path, rows: Sequence[int] = (1, 8), api_threads: int = 2) -> list[Family]:
    """The modes that apply to this folder, and those that do not (with the reason)."""
    man = mf.load(engines)
    out = [Family((REFERENCE, "generate: default"), _api), Family(("specrt generate",), _cli),
           Family((f"api: {api_threads} threads",), _threaded(api_threads)),
           Family(("server: one-request",), _server(None)), Family(("triton: one-request",), _triton(None))]
    if man.batch is None:
        why = "no batched model (manifest has no `batch`): build with `specrt build ... --batch`"
        r = ",".join(str(r) for r in rows)
        return out + [Family((f"open_batch {r}: alone, generate_batch, threads",), None, why),
                      Family((f"server: --max-num-seqs {r}",), None, why),
                      Family((f"triton: max_num_seqs {r}",), None, why)]
    for r in rows:
        out += [Family(tuple(f"open_batch {r}: {k}" for k in ("alone", "generate_batch", "threads")), _batched(r)),
                Family((f"server: --max-num-seqs {r}",), _server(r)),
                Family((f"triton: max_num_seqs {r}",), _triton(r))]
    top = max(rows)
    out.append(Family((f"open_batch {top}, prefill budget 1024: generate_batch",), _budgeted(top)))
    return out


def first_difference(ref: Answer, got: Answer) -> int | None:
    """Where `got` first departs from `ref`: a token index (a character index when `got` is
    text only); None when they are equal."""
    a, b = (ref.tokens, got.tokens) if got.tokens is not None else (ref.text, got.text)
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def compare(name: str, answers: list[list[Answer]], reference: list[list[Answer]]) -> dict:
    """One mode's row: per setting, how many prompts equal the reference, and the first
    difference (greedy's before the sample's)."""
    row = {"mode": name, "compared": "text" if answers[0] and answers[0][0].tokens is None else "tokens",
           "prompts": len(reference[0]), "first_difference": None}
    for setting, got, ref in zip(SETTINGS, answers, reference):
        diffs = [(j, first_difference(r, g)) for j, (r, g) in enumerate(zip(ref, got))]
        row[f"{setting}_equal"] = sum(d is None for _, d in diffs)
        j, pos = next(((j, d) for j, d in diffs if d is not None), (None, None))
        if j is not None and row["first_difference"] is None:
            row["first_difference"] = {"setting": setting, "prompt": j, "position": pos,
                                       "unit": "token" if row["compared"] == "tokens" else "character"}
    return row


def check_modes(engines: str | Path, prompts: Sequence[str], *, max_new_tokens: int = 64,
                rows: Sequence[int] = (1, 8), temperature: float = 0.8, seed: int = 7, threads: int = 2,
                families: Sequence[Family] | None = None,
                progress: Callable[[str], None] | None = lambda s: print(s, file=sys.stderr, flush=True)) -> dict:
    """Every mode of `plan(engines, rows)` (or `families`) on `prompts` (text; the chat template
    is applied), each compared with the reference. The report's `equal` is True when every
    mode that applies gave the reference's greedy tokens and its seeded sample."""
    from specrt.runtime.prompt import encode_prompt
    from specrt.runtime.tokenizer import Tokenizer
    if not isinstance(max_new_tokens, int) or isinstance(max_new_tokens, bool) or max_new_tokens < 1:
        raise ConfigError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 1")
    if not rows or any(not isinstance(r, int) or isinstance(r, bool) or not 1 <= r <= 256 for r in rows):
        raise ConfigError(f"rows={list(rows)!r}: give row counts in [1, 256], e.g. 1,8")
    root = Path(engines)
    man = mf.load(root)
    tok = Tokenizer(root, man.tokenizer)
    encoded = [(p, encode_prompt(tok, p, chat=True)) for p in prompts]
    cases = [Case(p, tuple(ids), i) for i, (p, ids) in enumerate(encoded)
             if len(ids) + max_new_tokens <= man.shapes.max_context]
    if not cases:
        raise ConfigError(f"none of the {len(prompts)} prompts leaves room for {max_new_tokens} new tokens in "
                          f"max_context={man.shapes.max_context}: give shorter prompts or fewer --max-new-tokens")
    job = Job(root, max_new_tokens, (SamplingParams(), SamplingParams(temperature=temperature, seed=seed)), threads)
    families = plan(root, rows) if families is None else families
    reference, modes = None, []
    for fam in families:
        if fam.run is None:
            modes += [{"mode": name, "na": fam.why_not} for name in fam.names]
            if progress:
                progress(f"check-modes: {', '.join(fam.names)}: n/a ({fam.why_not})")
            continue
        t0 = time.perf_counter()
        for name, answers in fam.run(cases, job):
            if reference is None:
                if name != REFERENCE:
                    raise ConfigError(f"the first mode must be {REFERENCE!r} (the reference), not {name!r}")
                reference = answers
            row = compare(name, answers, reference) | {"seconds": round(time.perf_counter() - t0, 1)}
            if row["first_difference"] is not None:
                row["first_difference"]["prompt"] = cases[row["first_difference"]["prompt"]].index
            modes.append(row)
            if progress:
                progress(f"check-modes: {name}: greedy {row['greedy_equal']}/{row['prompts']}, sample "
                         f"{row['sample_equal']}/{row['prompts']} equal ({row['seconds']} s)")
            t0 = time.perf_counter()
    ran = [m for m in modes if "na" not in m]
    return {"engines": str(engines), "prompts": len(cases), "skipped_prompts": len(prompts) - len(cases),
            "max_new_tokens": max_new_tokens, "sample": {"temperature": temperature, "seed": seed},
            "how": "each mode's greedy answer vs the reference's (SpeculativeGenerator, method='plain'); each "
                   "mode's seeded sample vs the reference's seeded sample; tokens where the mode returns them, "
                   "else text; every mode stops at EOS",
            "modes": modes, "equal": all(m["greedy_equal"] == m["sample_equal"] == m["prompts"] for m in ran),
            "reference_tokens": {k: [list(a.tokens) for a in answers]
                                 for k, answers in zip(SETTINGS, reference or [[], []])}}


def held_out_check(engines: str | Path, *, prompt_file: str | None = None, n_prompts: int = 12, **kw) -> dict:
    """`specrt check-modes`: check_modes on the first n_prompts held-out prompts of a prompt
    file (dataset.split, as `specrt quality`; default: the shipped set)."""
    from specrt.calibration.dataset import load_prompts, split
    held_out = split(load_prompts(prompt_file))[1][:n_prompts]
    report = check_modes(engines, [p.text for p in held_out], **kw)
    report["prompt_file"] = prompt_file or "shipped (specrt/calibration/data/prompts.jsonl)"
    report["prompt_ids"] = [p.id for p in held_out]
    return report


def format_table(report: dict) -> str:
    rows = report["modes"]
    n = max(len("mode"), *(len(m["mode"]) for m in rows))
    head = f"{'mode':<{n}}  {'greedy = ref':>12}  {'sample = ref':>12}  first difference"
    lines = [f"check-modes {report['engines']}: {report['prompts']} prompts x {report['max_new_tokens']} tokens, "
             f"greedy and a seeded sample (temperature {report['sample']['temperature']}, seed "
             f"{report['sample']['seed']}); reference: {REFERENCE}", head, "-" * len(head)]
    for m in rows:
        if "na" in m:
            lines.append(f"{m['mode']:<{n}}  {'n/a':>12}  {'n/a':>12}  {m['na']}")
            continue
        d = m["first_difference"]
        where = "-" if d is None else f"{d['setting']}: prompt {d['prompt']}, {d['unit']} {d['position']}"
        k = m["prompts"]
        lines.append(f"{m['mode']:<{n}}  {str(m['greedy_equal']) + '/' + str(k):>12}  "
                     f"{str(m['sample_equal']) + '/' + str(k):>12}  {where}"
                     + ("  (text)" if m["compared"] == "text" else ""))
    lines.append("all equal" if report["equal"] else "DIFFERENT: an engine folder gives other answers depending on "
                 "how it is called")
    return "\n".join(lines)
