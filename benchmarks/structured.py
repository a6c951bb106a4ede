"""Structured outputs on a real engine folder: what they cost and whether speculation changes them.

    .venv/bin/python benchmarks/structured.py artifacts/smollm2 [--port 8123]

1. starts `specrt serve FOLDER --max-num-seqs 4`, asks it through the official `openai`
   client for a JSON object matching a schema (response_format json_schema) and for a
   regex-constrained answer (vLLM's guided_regex), streaming and not, greedy and seeded
   sampled, and checks each answer against its schema or expression;
2. runs the same requests in-process on the folder's batched engine with speculation off
   (`open_batch(speculate=False)`) and prints whether every answer is the same;
3. times, in one interleaved run, the same prompts unconstrained with speculation, constrained
   with speculation and constrained on plain steps (`open_batch(speculate=False)`: the same
   tokens, so their ratio is speculation's gain under a grammar), and the grammar mask per call.
Prints a table; exits non-zero if an answer does not match its schema or differs.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                           "country": {"type": "string", "maxLength": 40},
                                           "population_millions": {"type": "number"},
                                           "capital": {"type": "boolean"}},
          "required": ["city", "country", "population_millions", "capital"], "additionalProperties": False}
REGEX = r"(Yes|No)\. [A-Z][a-z ,]{5,80}\."
PROMPTS = ["Describe Paris as JSON.", "Give me facts about Tokyo in JSON.", "What about Lima? Answer in JSON.",
           "Is the sky blue? Answer yes or no, then one short sentence.",
           "Can fish fly? Answer yes or no, then one short sentence.", "Tell me about Oslo as a JSON object."]
NEW = 64


def _valid(obj) -> bool:
    return set(obj) == set(SCHEMA["required"]) and isinstance(obj["city"], str) and isinstance(obj["capital"], bool) \
        and isinstance(obj["population_millions"], (int, float)) and isinstance(obj["country"], str)


def requests():
    """(prompt, field, value, check, sampling) for every case."""
    out = []
    for i, p in enumerate(PROMPTS):
        if "JSON" in p:
            fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}
            out.append((p, "response_format", fmt, lambda t: _valid(json.loads(t)), {"json_schema": SCHEMA}))
        else:
            out.append((p, "guided_regex", REGEX, lambda t: re.fullmatch(REGEX, t) is not None, {"regex": REGEX}))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("engines", type=Path)
    ap.add_argument("--port", type=int, default=8123)
    args = ap.parse_args()
    import openai

    from specrt.runtime.batch.generator import open_batch
    from specrt.runtime.sampling import SamplingParams

    server = subprocess.Popen([str(Path(sys.executable).parent / "specrt"), "serve", str(args.engines), "--max-num-seqs", "4",
                               "--port", str(args.port)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    bad = 0
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{args.port}/v1", api_key="x", max_retries=0, timeout=300)
        for _ in range(600):
            try:
                model = client.models.list().data[0].id
                break
            except openai.APIConnectionError:
                time.sleep(0.5)
        else:
            raise SystemExit("the server did not start: " + server.stderr.read().decode()[-2000:])
        served = {}
        print(f"{'prompt':42} {'field':16} {'mode':16} valid  same-without-speculation")
        with open_batch(args.engines, max_num_seqs=1, speculate=False) as plain:
            for prompt, field, value, check, structured in requests():
                for temp, seed in ((0.0, None), (0.8, 7)):
                    for stream in (False, True):
                        kw = dict(model=model, messages=[{"role": "user", "content": prompt}], max_tokens=NEW,
                                  temperature=temp, seed=seed)
                        kw |= {"response_format": value} if field == "response_format" else {"extra_body": {field: value}}
                        if stream:
                            text = "".join(c.choices[0].delta.content or "" for c in
                                           client.chat.completions.create(stream=True, **kw) if c.choices)
                        else:
                            text = client.chat.completions.create(**kw).choices[0].message.content
                        ok = bool(check(text)) if text else False
                        want = plain.generate(prompt, chat=True, max_new_tokens=NEW, structured=structured,
                                              sampling=SamplingParams(temperature=temp, seed=seed)).text
                        same = text == want
                        bad += not (ok and same)
                        mode = ("greedy" if not temp else f"t={temp} seed={seed}") + (" stream" if stream else "")
                        print(f"{prompt[:42]:42} {field:16} {mode:16} {str(ok):6} {same}")
                        served[(prompt, temp)] = text
        for (prompt, temp), text in served.items():
            if not temp:
                print(f"  {prompt[:40]!r}: {text!r}")
    finally:
        server.terminate()
        server.wait(30)

    # cost, one interleaved run: the same prompts free and constrained, speculation on
    from specrt.runtime import grammar as gr
    calls, spent = [0], [0.0]
    real = gr.Matcher.allowed

    def timed(self):
        t0 = time.perf_counter()
        try:
            return real(self)
        finally:
            spent[0] += time.perf_counter() - t0
            calls[0] += 1
    gr.Matcher.allowed = timed
    arms = {"free, speculating": (True, False), "constrained, speculating": (True, True),
            "constrained, plain steps": (False, True)}
    tot = {name: [0.0, 0, []] for name in arms}
    with open_batch(args.engines, max_num_seqs=1) as spec, open_batch(args.engines, max_num_seqs=1,
                                                                       speculate=False) as plain:
        for _ in range(2):
            for prompt, _f, _v, _c, structured in requests():
                for name, (speculate, constrained) in arms.items():     # interleaved, prompt by prompt
                    g = spec if speculate else plain
                    t0 = time.perf_counter()
                    c = g.generate(prompt, chat=True, max_new_tokens=NEW, structured=structured if constrained else None)
                    tot[name][0] += time.perf_counter() - t0
                    tot[name][1] += len(c.tokens)
                    tot[name][2].append(c.tokens)
    for name, (s, n, _) in tot.items():
        print(f"{name:26} {n} tokens in {s:.2f} s: {n / s:.1f} tok/s (prompt included)")
    a, b = tot["constrained, speculating"], tot["constrained, plain steps"]
    print(f"constrained: speculating / plain steps = x{(a[1] / a[0]) / (b[1] / b[0]):.2f} "
          f"(the same tokens: {a[2] == b[2]})")
    print(f"grammar mask: {calls[0]} calls, {1e6 * spent[0] / max(calls[0], 1):.0f} us per call")
    print("FAIL" if bad else "all answers valid and equal without speculation")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
