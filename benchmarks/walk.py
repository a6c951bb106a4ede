"""The walk of one request through specrt's files, from the HTTP handler to the ONNX Runtime call
and back: how many files a reader enters and how often the path comes back to a file it left.

    .venv/bin/python benchmarks/walk.py artifacts/smollm2 [--max-num-seqs 8]
        [--max-tokens 4] [--show]

Builds the app `specrt serve` runs (in process, no socket), sends one warm-up request, then
records a second one, `POST /v1/chat/completions` with `--max-tokens` new tokens, greedy. A profile
hook on every thread (sys.setprofile, threading.setprofile) sees each Python call and return;
only frames in specrt's own files count, plus ONNX Runtime's `InferenceSession.run` and `run_with_iobinding` (shown as
`[onnxruntime run]`). A thread's walk is the time-ordered sequence of files its code is in (a
return counts as coming back to the caller's file; a coroutine's await and resumption do not
count); consecutive events in one file are one *stay*; a stay in a file the walk has already
left is a *return*. The request crosses threads (the event loop's handler, a worker or the
batched engine's thread): their walks are counted each and summed. The engine threads' idle
polls between requests are left out: recording starts when the request is sent and ends
when its answer arrives, and a poll that finds no work adds nothing once collapsed per step.

Prints stays, returns, files entered, and with --show the walk itself. Not part of `make test`
(it measures the code's shape, not its behaviour).
"""
from __future__ import annotations

import argparse
import asyncio
import dis
import sys
import threading
from pathlib import Path

import httpx

import specrt
from specrt.serve.server import ServeConfig, build_app

ROOT = str(Path(specrt.__file__).resolve().parent) + "/"
ORT_RUN = "[onnxruntime run]"
YIELD = dis.opmap["YIELD_VALUE"]


class Recorder:
    def __init__(self):
        self.on, self.events, self.lock, self.suspended = False, [], threading.Lock(), set()

    def _where(self, frame) -> str | None:
        code = frame.f_code
        if code.co_filename.startswith(ROOT):
            return code.co_filename[len(ROOT):]
        if code.co_name in ("run", "run_with_iobinding") and \
                code.co_filename.endswith("onnxruntime_inference_collection.py"):
            return ORT_RUN
        return None

    def hook(self, frame, event, arg):
        if not self.on or event not in ("call", "return"):
            return
        here = self._where(frame)
        if here is None:
            return
        # a coroutine or generator that suspends (await, yield) and resumes has not left its
        # file in the reader's sense: its suspensions and resumptions are not steps of the walk
        if event == "return" and frame.f_lasti >= 0 and frame.f_code.co_code[frame.f_lasti] == YIELD:
            self.suspended.add(id(frame))
            return
        if event == "call" and id(frame) in self.suspended:
            self.suspended.discard(id(frame))
            return
        if event == "return":           # back in the caller's file, if it is one of ours
            back = frame.f_back
            while back is not None and self._where(back) is None:
                back = back.f_back
            here = self._where(back) if back is not None else None
            if here is None:
                return
        with self.lock:
            self.events.append((threading.get_ident(), here))


def stays(events: list[str]) -> list[str]:
    out: list[str] = []
    for e in events:
        if not out or out[-1] != e:
            out.append(e)
    return out


def returns(walk: list[str]) -> int:
    seen, n = set(), 0
    for i, f in enumerate(walk):
        if f in seen:
            n += 1
        if i:
            seen.add(walk[i - 1])
    return n


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("engines")
    p.add_argument("--max-num-seqs", type=int, default=None, help="the batched server (default: one request per worker)")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--show", action="store_true", help="print the walk, one stay per line")
    a = p.parse_args(argv)

    rec = Recorder()
    sys.setprofile(rec.hook)
    threading.setprofile(rec.hook)
    app, pool = build_app(ServeConfig(a.engines, max_num_seqs=a.max_num_seqs))
    pool.start()
    body = {"model": ServeConfig(a.engines).served_name, "temperature": 0, "max_tokens": a.max_tokens,
            "messages": [{"role": "user", "content": "Why is the sky blue?"}]}

    async def ask():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as c:
            r = await c.post("/v1/chat/completions", json=body, timeout=300)
            r.raise_for_status()
            rec.on = True
            r = await c.post("/v1/chat/completions", json=body, timeout=300)
            rec.on = False
            r.raise_for_status()
            return r.json()
    try:
        out = asyncio.run(ask())
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        pool.close()
    threads: dict[int, list[str]] = {}
    for tid, f in rec.events:           # each thread's walk, threads in the order they joined in
        threads.setdefault(tid, []).append(f)
    walks = [stays(fs) for fs in threads.values()]
    mode = f"--max-num-seqs {a.max_num_seqs}" if a.max_num_seqs else "one row"
    print(f"{a.engines} ({mode}), {a.max_tokens} tokens: {out['choices'][0]['message']['content']!r}")
    print(f"threads {len(walks)}, stays {sum(map(len, walks))}, returns {sum(map(returns, walks))}, "
          f"files entered {len({f for w in walks for f in w})}")
    if a.show:
        for i, w in enumerate(walks):
            print(f"thread {i + 1}: {len(w)} stays, {returns(w)} returns")
            for f in w:
                print("  " + f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
