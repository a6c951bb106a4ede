"""Opening an engine folder as a BatchEngine: its batched model (the backend's batched runner,
the round policy from the build's costs and invariance verdicts, a draft or trained head
inside the batch) or, for a folder without one, its one-row graphs on one row (one_row.py).
generator.open_batch wraps the result in a BatchGenerator; runtime/one.py steps it from the
caller's thread (the batch of one).
"""
from __future__ import annotations

from typing import Sequence

from specrt.errors import ConfigError, ManifestError
from specrt.runtime.batch.engine import BatchEngine


def batch_engine(engines, *, max_num_seqs: int = 8, threads: int = 2, verify: str = "full",
                 buckets: Sequence[int] | None = None, execution: str = "cpu", speculate: bool = True,
                 memory: str = "fast", head: str | None = None):
    """(BatchEngine, Tokenizer) of an engine folder, as open_batch describes, with no thread
    stepping it (BatchEngine.drive runs a request from the caller's thread)."""
    from pathlib import Path

    from specrt import manifest as mf
    from specrt.runtime.backends import backend_for
    from specrt.runtime.grammar import grammars_for
    from specrt.runtime.tokenizer import Tokenizer
    if not isinstance(max_num_seqs, int) or isinstance(max_num_seqs, bool) or not 1 <= max_num_seqs <= 256:
        raise ConfigError(f"max_num_seqs={max_num_seqs!r}: give an integer in [1, 256]")
    if verify not in mf.VERIFY_MODES:
        raise ConfigError(f"verify={verify!r}; choose one of {mf.VERIFY_MODES}")
    root = Path(engines)
    man = mf.load(root)
    backend = backend_for(man)
    backend.check_device(man)      # as SpeculativeGenerator: another device or CPU int8 path is refused
    mf.check_files(man, root)
    entry = man.batch
    if memory not in backend.memory_modes:
        raise ConfigError(f"memory={memory!r}; choose one of {backend.memory_modes}")
    if entry is not None and memory != "fast":
        raise ConfigError(f"memory={memory!r} sets up a folder's one-row graphs; {root} serves its batched model (one "
                          "copy of the weights for every row): leave it out (--memory fast)")
    if entry is None and buckets is not None:
        raise ConfigError(f"{root} has no batched model, so it has no row buckets: rebuild it with `specrt build ... "
                          "--batch`, or open it without buckets")
    if head is not None and (entry is None or buckets is not None or not speculate):
        raise ConfigError(f"a draft head drafts inside the batched model: {root} has none (rebuild it with `specrt build "
                          "... --batch --hidden-layers ...`)" if entry is None else
                          "a draft head with buckets or speculate=False: the head would never run; leave it out")
    if entry is None and max_num_seqs == 1:
        return _one_row(root, man, backend, threads, verify, speculate, memory)
    if entry is None:
        raise ConfigError(f"{root} has no batched model: rebuild it with `specrt build ... --batch` to serve many "
                          "requests on one engine, or open it with max_num_seqs=1 (its one-row graphs, one request at "
                          "a time), or serve it with --workers N (one request per engine copy)")
    check_batch_entry(entry)
    inv = entry.parity.get("batch_invariance") or {}
    if inv.get("equal") is not True:
        raise ConfigError(f"{root}: the build did not show that the batched graph computes each row independently of "
                          "the others (manifest models.batch.parity.batch_invariance): rebuild with this specrt")
    if backend.open_batch is None:
        raise ConfigError(f"{root}: the {backend.name} backend has no batched runner yet: serve this folder with "
                          "--workers N (one request per engine copy), or build it for ort-cpu")
    check = mf.HashCheck(man, root) if verify == "full" else None
    # "prefill": the int8 prompt-chunk graph of `--batch-prefill rowwise` builds
    graphs = tuple(g for g in ("step", "prefill") if g in entry.graphs)
    model = backend.open_batch(root, entry, man.shapes, rows=max_num_seqs, graphs=graphs, threads=threads,
                               buckets=buckets, execution=execution)
    policy, min_tokens = _policy(root, man, entry, speculate and buckets is None)
    draft = trained = None
    if head is not None:
        from specrt.runtime.head import open_for_batch
        trained, policy = open_for_batch(head, root, man, entry, policy, max_num_seqs, threads)
    elif policy.has_draft and man.batch_draft is not None:
        # a draft model inside the batch, with its own cache: it prefills each prompt beside the
        # target and catches each row up on the tokens its cache lacks (runtime/batch/engine.py)
        draft = backend.open_batch(root, man.batch_draft, man.shapes, rows=max_num_seqs, threads=threads, min_rows=1)
    elif policy.has_draft:
        # the int8 self-draft inside the batch: its "draft" graph over the target's cache (what it
        # writes past a row's length the verify pass overwrites), one token a row per step
        draft = backend.open_batch(root, entry, man.shapes, rows=max_num_seqs, graphs=("draft",), serves="draft",
                                   cache=model.cache, threads=threads, min_rows=1)
    if check is not None:
        check.result()
    tok = Tokenizer(root, man.tokenizer)
    grammars = grammars_for((root / man.tokenizer["file"]).read_text(encoding="utf-8"),
                            tuple(sorted(tok.eos_token_ids)), int(entry.dims["vocab"]))
    from specrt.runtime.backends.batch_calls import lone_prefill_tokens, prompt_rows
    engine = BatchEngine(model, max_num_seqs=max_num_seqs, max_context=man.shapes.max_context,
                         prefill_tokens=man.shapes.prefill_chunk, k_max=man.shapes.k,
                         vocab=int(entry.dims["vocab"]), policy=policy, tokenizer=tok, min_tokens=min_tokens,
                         draft=draft, head=trained,
                         lone_prefill_tokens=lone_prefill_tokens(entry, man.shapes) if buckets is None else None,
                         prompt_rows=prompt_rows(entry) if buckets is None else 1)
    engine.grammars = grammars
    return engine, tok


def _one_row(root, man, backend, threads: int, verify: str, speculate: bool, memory: str = "fast"):
    """A folder without a batched model (no --batch, the GPU builds): its one-row graphs as the
    engine's model, one row (batch/one_row.py), its rounds chosen as SpeculativeGenerator's
    default method chooses them (the tokens are the same whatever the rounds). A service
    speculates: with a draft, a quantized target also loads its one-token graph (plain and pair
    rounds where drafting does not pay: on SmolLM2 int4 twice a request's speed, 98-104 vs 41-50
    tok/s measured 2026-12-01), an fp32 one does not (another pre-packed copy of the fp32
    weights): its plain steps run in the verify window and every round drafts k."""
    from specrt.runtime.batch.one_row import open_folder
    from specrt.runtime.batch.policy import BatchPolicy
    speculate = speculate and man.draft is not None
    if not speculate:
        graphs = ("prefill", "decode")
    elif man.target.precision != "fp32":
        graphs = ("prefill", "decode", "verify")
    else:
        graphs = ("prefill", "verify")
    engine, tok, fixed, _, _ = open_folder(root, man, backend, threads=threads, verify=verify, graphs=graphs,
                                           draft=speculate, memory=memory)
    # no measured costs, or no one-token graph (a plain step would cost a verify pass): fixed-k
    # rounds, as the single stream runs them
    engine.policy.fixed = fixed or "decode" not in graphs
    if not speculate:
        engine.policy = BatchPolicy(None, man.shapes.k)
    return engine, tok


def check_batch_entry(entry) -> None:
    """What open_batch trusts in models.batch beyond manifest.load's checks: the parity verdicts
    it reads are objects, and the rowwise prefill graph the build says it made (source.prefill_graph)
    is listed: without it prompt chunks would silently run through the step graph (other tokens)."""
    parity = entry.parity
    if not isinstance(parity, dict) or not all(isinstance(parity.get(k) or {}, dict)
                                               for k in ("batch_invariance", "window_invariance")):
        raise ManifestError("models.batch.parity and its batch_invariance / window_invariance must be objects: "
                            "the manifest was edited; rebuild the engines with `specrt build ... --batch`")
    for graph in ("prefill", "draft"):
        if (f"{graph}_graph" in (entry.source or {})) != (graph in entry.graphs):
            raise ManifestError(f"models.batch lists a {graph} graph without the build's source.{graph}_graph, or the "
                                "reverse: the manifest was edited; rebuild the engines with `specrt build ... --batch`")


def _policy(root, man, entry, speculate: bool):
    """(policy, min_tokens): speculation per step by measured cost where the build showed it
    cannot change a row's tokens (see open_batch), every pass with at least the windows'
    min_tokens a row; plain one-token steps otherwise."""
    from specrt.runtime.batch.policy import BatchCosts, BatchPolicy
    from specrt.runtime.ngrams import NgramTable
    from specrt.runtime.proposers import Chain, OneGram, PromptLookup, TableGuess
    k = man.shapes.k
    costs = BatchCosts.from_manifest((man.build or {}).get("speculation"))     # build: optional
    from specrt.runtime.backends.batch_calls import min_tokens as pass_tokens
    min_tokens = pass_tokens(entry, k)      # plain steps too: the same tokens with or without speculation
    if (entry.parity.get("window_invariance") or {}).get("equal") is not True:
        return BatchPolicy(None, k), min_tokens
    if not speculate or costs is None:
        return BatchPolicy(None, k), min_tokens
    ngrams = (man.proposers or {}).get("ngrams")
    table = [TableGuess(NgramTable.load(root / ngrams["file"]))] if ngrams else []
    # a draft inside the batch (the int8 self-draft's graph, or a draft model with its own
    # cache), and its step cost the build measured
    own = man.batch_draft
    draft = ("draft" in entry.graphs or own is not None) and costs.draft(1) is not None
    priors = {"draft": _draft_prior(own or entry)} if draft else None
    return BatchPolicy(costs, k, lookup=PromptLookup(2, k), pair_guess=Chain([OneGram()] + table), draft=draft,
                       priors=priors), min_tokens


def _draft_prior(entry) -> float:
    """The batched draft's prior acceptance: its top-1 agreement with the batched target that
    the build measured (models.batch.parity.draft_agreement, or models.batch_draft's)."""
    agreement = entry.parity.get("draft_agreement") if isinstance(entry.parity, dict) else None
    v = agreement.get("top1_agreement") if isinstance(agreement, dict) else None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
        raise ManifestError(f"models.{entry.role}.parity.draft_agreement.top1_agreement={v!r} is not a number in [0, 1]: "
                            "the manifest was edited; rebuild the engines with `specrt build ... --batch`")
    return float(v)
