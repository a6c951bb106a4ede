"""One request through the batched engine over one-row runners, as SpeculativeGenerator runs a
folder's one-row graphs (specrt/runtime/batch/one_row.py: one_row_engine): the GPU backends'
runners (ort-cuda, tensorrt) adapted by OneRowModel, a batch of one, driven from this thread.

    drive(target, prompt, n, shapes, draft=None) -> (tokens, from_draft flags, Done.metrics)
    engine(target, shapes, draft=None), run(engine, prompt, n): the same, an engine kept for
        more requests

draft=None: plain decoding (one target step a token); with a draft runner (its own cache, or a
self-draft over the target's), fixed-k rounds: every round drafts k tokens and verifies them.
Greedy (SamplingParams()), no tokenizer, no EOS: the request runs to its budget."""
from __future__ import annotations

from specrt.runtime.batch.engine import BatchEngine
from specrt.runtime.batch.one_row import OneRowModel, graph_tokens
from specrt.runtime.batch.policy import BatchPolicy
from specrt.runtime.batch.request import Delta, Done, Request
from specrt.runtime.sampling import SamplingParams


def model(runner) -> OneRowModel:
    """The runner as a one-row BatchModel over the graphs it loaded (their static T)."""
    names = getattr(runner, "names", None) or tuple(runner.graphs)     # (the ort-cpu runner has no names)
    return OneRowModel(runner, graph_tokens(runner.entry, names))


def engine(target, shapes, draft=None) -> BatchEngine:
    k, vocab = shapes.k, int(target.entry.dims["vocab"])
    policy = BatchPolicy(None, k, draft=True, fixed=True) if draft is not None else BatchPolicy(None, k)
    return BatchEngine(model(target), max_num_seqs=1, max_context=shapes.max_context,
                       prefill_tokens=shapes.prefill_chunk, k_max=k, vocab=vocab, policy=policy, tokenizer=None,
                       eos=frozenset(), min_tokens=1, draft=None if draft is None else model(draft))


def run(eng: BatchEngine, prompt, n: int, seed: int = 0):
    """(tokens, from_draft flags, metrics) of one greedy request of n new tokens on `eng`."""
    tokens, flags, done = [], [], None
    for ev in eng.drive(Request(list(prompt), n, SamplingParams(), seed)):
        if isinstance(ev, Delta):
            tokens += ev.tokens
            flags += ev.from_draft
        elif isinstance(ev, Done):
            done = ev
    assert done is not None and done.finish_reason == "length" and done.completion_tokens == len(tokens) == n, done
    return tokens, flags, done.metrics


def drive(target, prompt, n: int, shapes, draft=None):
    """run() on a fresh engine over the runners."""
    return run(engine(target, shapes, draft), prompt, n)
