"""Sampling is lossless end to end: tokens from the speculative generator (ONNX graphs,
draft proposals, accept rule, KV rewinds) follow the target's warped distribution.

Each run generates K + 2 tokens, so the first verify pass scores a full window of K
draft tokens (every draft row of the workspace is used), and the first three tokens are
compared with their exact distribution: enumerated with the Hugging Face target and
warped by temperature, top-k and top-p written out here from their definitions (shares
no code with specrt; cross-checked against transformers' own warpers). The parameters
are chosen so that each of the three warps changes the distribution at most positions
(asserted), so a warp that the draft or the target skips shows. Chi-square (cells
expected < 5 pooled) and a total-variation bound, via tests/goodness_of_fit.py; the
same check with a deliberately wrong accept rule must fail, which shows it can tell (the
wrong rule is put where the batched engine, which runs every request, looks the rule up:
specrt.runtime.batch.engine.first_mismatch).
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from goodness_of_fit import P_VALUE_CEILING, goodness_of_fit

from specrt.runtime import SamplingParams, SpeculativeGenerator
from specrt.runtime import choice as choice_mod
from specrt.runtime.batch import engine as engine_mod
from specrt.runtime.batch.policy import NONE, BatchPolicy, RoundKind, StepChoice

PROMPT = [40, 50, 60, 70]
K = 3                       # conftest.build_tiny's default
NEW = K + 2                 # first token from the prefill, then a full window of K drafts
DEPTH = 3                   # tokens whose joint distribution is compared
N = 3000
PARAMS = dict(temperature=1.3, top_k=6, top_p=0.8)   # each warp cuts at most positions (asserted)


def warp_by_definition(logits: np.ndarray, temperature: float, top_k: int, top_p: float,
                       min_p: float = 0.0) -> np.ndarray:
    """[V] float64: softmax(logits / T); keep the top_k most likely, renormalise; keep the
    fewest most likely whose mass reaches top_p, renormalise; keep those at least min_p times
    as likely as the most likely, renormalise (transformers' order)."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    ranked = sorted(range(p.size), key=lambda i: -p[i])
    kept = ranked[:top_k]
    mass = sum(p[i] for i in kept)
    nucleus, running = [], 0.0
    for i in kept:
        nucleus.append(i)
        running += p[i] / mass
        if running >= top_p:
            break
    nucleus = [i for i in nucleus if p[i] >= min_p * p[nucleus[0]]]   # a ratio: renormalising keeps it
    out = np.zeros_like(p)
    out[nucleus] = p[nucleus]
    return out / out.sum()


def warp_by_transformers(logits: np.ndarray) -> np.ndarray:
    import torch
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    chain = LogitsProcessorList([TemperatureLogitsWarper(PARAMS["temperature"]), TopKLogitsWarper(PARAMS["top_k"]),
                                 TopPLogitsWarper(PARAMS["top_p"])])
    scores = chain(torch.zeros(1, 1, dtype=torch.long), torch.tensor(logits, dtype=torch.float64)[None])
    return scores.softmax(-1)[0].numpy()


def warp_effects(logits: np.ndarray) -> dict[str, float]:
    """How much each warp changes one position's distribution, and how close the nearest
    top-k / top-p boundary is (a near-tie there could flip the support on float noise)."""
    t, k, tp = PARAMS["temperature"], PARAMS["top_k"], PARAMS["top_p"]
    plain = warp_by_definition(logits, 1.0, logits.size, 1.0)
    tempered = warp_by_definition(logits, t, logits.size, 1.0)
    top = np.sort(tempered)[::-1]
    cumulative = np.cumsum(top[:k]) / top[:k].sum()
    return {"temperature_tv": 0.5 * float(np.abs(tempered - plain).sum()),
            "top_k_cut": float(top[k:].sum()),
            "top_p_cut": float(1.0 - cumulative[np.searchsorted(cumulative, tp)]),
            "top_k_gap": float(top[k - 1] - top[k]),
            "top_p_gap": float(np.abs(cumulative - tp).min())}


def tree_of(model_dir, prompt: list[int], params: dict = PARAMS) -> dict:
    """{prefix: (logits at the position after prompt + prefix)} for every prefix of length
    < DEPTH with nonzero warped probability."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tree, frontier = {}, [()]
    for _ in range(DEPTH):
        nxt = []
        for prefix in frontier:
            with torch.no_grad():
                tree[prefix] = model(torch.tensor([prompt + list(prefix)])).logits[0, -1].double().numpy()
            nxt += [prefix + (int(t),) for t in np.flatnonzero(warp_by_definition(tree[prefix], **params))]
        frontier = nxt
    return tree


def exact_of(tree: dict, params: dict = PARAMS) -> dict[tuple, float]:
    """Exact distribution of the first DEPTH tokens under the warped target."""
    dist = {(): 1.0}
    for _ in range(DEPTH):
        dist = {prefix + (int(t),): pr * float(p[t])
                for prefix, pr in dist.items()
                for p in [warp_by_definition(tree[prefix], **params)] for t in np.flatnonzero(p)}
    assert abs(sum(dist.values()) - 1) < 1e-9
    return dist


@pytest.fixture(scope="module")
def target_tree(tiny_pair):
    return tree_of(tiny_pair[0], PROMPT)


@pytest.fixture(scope="module")
def exact(target_tree) -> dict[tuple, float]:
    return exact_of(target_tree)


def fit_of(exact: dict, counts: Counter):
    cells = list(exact)
    observed = np.array([counts.get(c, 0) for c in cells])
    return goodness_of_fit(observed, np.array([exact[c] for c in cells]), outside=sum(counts.values()) - observed.sum())


def sample_prefixes(gen: SpeculativeGenerator, n: int, method: str = "speculative", params: dict = PARAMS) -> Counter:
    """Counts of the first DEPTH tokens of n seeded generations of NEW tokens; checks that
    every speculative run verified a full window of K draft tokens."""
    counts = Counter()
    full_windows = 0
    for seed in range(n):
        sp = SamplingParams(**params, seed=seed)
        toks = [e.token for e in gen.tokens(PROMPT, max_new_tokens=NEW, sampling=sp, method=method)]
        assert len(toks) == NEW
        counts[tuple(toks[:DEPTH])] += 1
        full_windows += method == "speculative" and gen.last_metrics.drafted_at[K - 1] >= 1
    assert method == "plain" or full_windows == n, (full_windows, n)
    return counts


def test_the_reference_warp_matches_transformers_warpers(target_tree):
    for prefix, logits in target_tree.items():
        ours = warp_by_definition(logits, **PARAMS)
        theirs = warp_by_transformers(logits)
        np.testing.assert_array_equal(ours > 0, theirs > 0, err_msg=str(prefix))
        np.testing.assert_allclose(ours, theirs, atol=1e-12, err_msg=str(prefix))


def test_temperature_top_k_and_top_p_each_change_most_positions(target_tree, exact):
    effects = [warp_effects(logits) for logits in target_tree.values()]
    n = len(effects)
    assert n >= 8 and len(exact) >= 12, (n, len(exact))

    def share(key, threshold):
        return sum(e[key] > threshold for e in effects) / n

    assert share("temperature_tv", 0.02) >= 0.8, effects
    assert share("top_k_cut", 0.01) >= 0.8, effects     # top-k removes > 1% of the mass
    assert share("top_p_cut", 0.01) >= 0.8, effects     # then top-p removes > 1% more
    # no boundary is within float noise of the ONNX-vs-torch logits (~1e-5; ~1e-6 in probability)
    assert min(e["top_k_gap"] for e in effects) > 1e-4, effects
    assert min(e["top_p_gap"] for e in effects) > 1e-4, effects


# (kind, attention, runs): the returned-KV path and the shared cache get a smaller sample
ENGINES = [pytest.param("truncate:2", "gqa", N, id="truncate2-gqa"),
           pytest.param("truncate:2", "portable", N // 2, id="truncate2-portable"),
           pytest.param("int8", "gqa", N // 2, id="int8-shared-cache")]


@pytest.fixture(scope="module")
def gen(tiny_truncated_engines) -> SpeculativeGenerator:
    """The folder's one-row graphs on the batched engine (a batch of one, batch/one_row.py); no
    measured costs, so fixed rounds of K draft tokens unless a test scripts them."""
    g = SpeculativeGenerator(tiny_truncated_engines)
    assert g.target is not None and g.one.fixed, "a one-row folder without measured costs"
    return g


@pytest.mark.parametrize(("kind", "attention", "runs"), ENGINES)
def test_speculative_sampling_follows_the_target_distribution(tiny_matrix, tiny_truncated_engines, exact,
                                                              kind, attention, runs):
    engines = tiny_truncated_engines if (kind, attention) == ("truncate:2", "gqa") else tiny_matrix(kind, attention)
    fit = fit_of(exact, sample_prefixes(SpeculativeGenerator(engines), runs))
    assert fit.passes and fit.outside_support == 0, fit


def test_plain_sampling_follows_the_target_distribution(gen, exact):
    fit = fit_of(exact, sample_prefixes(gen, N // 2, method="plain"))
    assert fit.passes and fit.outside_support == 0, fit


def test_drafts_are_both_accepted_and_rejected_at_every_position(gen):
    accepted, drafted = np.zeros(K), np.zeros(K)
    for seed in range(300):
        list(gen.tokens(PROMPT, max_new_tokens=NEW, sampling=SamplingParams(**PARAMS, seed=seed)))
        accepted += gen.last_metrics.accepted_at
        drafted += gen.last_metrics.drafted_at
    # the check means something only if drafts are both accepted and rejected, at every row
    assert 0.1 < accepted.sum() / drafted.sum() < 0.9, (accepted, drafted)
    assert (accepted > 0).all() and (accepted < drafted).all(), (accepted, drafted)


MIN_P = dict(PARAMS, min_p=0.5)     # cuts part of what top-k and top-p leave at most positions (asserted)


@pytest.fixture(scope="module")
def min_p_exact(tiny_pair) -> dict[tuple, float]:
    tree = tree_of(tiny_pair[0], PROMPT, MIN_P)
    # the mass (after top-k and top-p) that min-p keeps, at each position of the tree
    kept = [warp_by_definition(x, **PARAMS)[warp_by_definition(x, **MIN_P) > 0].sum() for x in tree.values()]
    assert sum(k < 0.99 for k in kept) >= 0.5 * len(kept), kept     # min-p removes > 1% of the mass
    return exact_of(tree, MIN_P)


def test_min_p_sampling_follows_the_target_distribution(gen, min_p_exact):
    fit = fit_of(min_p_exact, sample_prefixes(gen, N // 2, params=MIN_P))
    assert fit.passes and fit.outside_support == 0, fit


def test_a_warp_that_skips_min_p_fails_the_same_check(gen, min_p_exact, monkeypatch):
    """The choices (the target's and the draft's: one warp, runtime/choice.py) skip min-p: the
    output leaves min-p's law."""
    from dataclasses import replace
    real = choice_mod.probs_from_logits
    monkeypatch.setattr(choice_mod, "probs_from_logits",
                        lambda x, params, out: real(x, replace(params, min_p=0.0), out))
    fit = fit_of(min_p_exact, sample_prefixes(gen, N // 2, params=MIN_P))
    assert not fit.passes, fit


def _always_accept(logits, proposal, params, seed, position, scratch):
    """Wrong: keeps every draft token whatever the target chose (the output follows the draft)."""
    k = len(proposal)
    return k, choice_mod.choose(logits[k], params, seed, position + k, scratch)


def _redraw_after_a_rejection(logits, proposal, params, seed, position, scratch):
    """Wrong: after a rejected draft token, a fresh draw from p (noise of its own) instead of the
    target's choice there: the rejected token comes back too often."""
    n, y = choice_mod.first_mismatch(logits, proposal, params, seed, position, scratch)
    if n == len(proposal):
        return n, y
    return n, choice_mod.choose(logits[n], params, seed + 1_000_003, position + n, scratch)


@pytest.mark.parametrize("wrong", [_always_accept, _redraw_after_a_rejection])
def test_a_wrong_accept_rule_fails_the_same_check(gen, exact, monkeypatch, wrong):
    monkeypatch.setattr(engine_mod, "first_mismatch", wrong)      # where engine.py's _verify looks it up
    fit = fit_of(exact, sample_prefixes(gen, N // 2))
    assert not fit.passes and fit.p_value < P_VALUE_CEILING, fit


class Scripted(BatchPolicy):
    """A policy (runtime/batch/policy.py's interface) for a batch of one that plays a fixed
    script of rounds, plain steps and prompt-lookup rounds included, whatever verdicts it sees.
    A lookup entry falls back to the draft when prompt lookup has no guess this round; a pair
    entry is a plain step without a two-token decode graph or a one-token guess; an entry's k
    is cut to the row's room, and a round left with nothing to propose is a plain step. Its
    proposers (prompt lookup, the one-token guessers, the draft) are those of `like`, the
    policy the generator made for the request."""

    def __init__(self, script, like: BatchPolicy):
        super().__init__(None, like.k_max, lookup=like.lookup, pair_guess=like.pair_guess, draft=like.has_draft,
                         priors=like.priors, pair=like.has_pair)
        self.script, self.i = list(script), 0

    def choose(self, rows, graph_t) -> StepChoice:
        (row,) = rows
        how, k = self.script[self.i % len(self.script)]
        self.i += 1
        room = max(min(self.k_max, row.room), 0)
        k = min(k, room)
        guess = self._guess(row.seq, room) if self.lookup is not None else NONE
        if how == "lookup":
            how, k = ("lookup", min(k, len(guess))) if len(guess) else ("draft", k)
        one = NONE
        if how == "pair" and self.has_pair and room:
            one = guess[:1] if len(guess) else self._one(row.seq)
        if how == "pair" and not len(one):
            how, k = "plain", 0
        if how == "plain" or not k:
            return StepChoice(RoundKind.PLAIN, graph_t("decode", 1, 1), [NONE])
        if how == "pair":
            return StepChoice(RoundKind.PAIR, graph_t("decode", 2, 1), [one])
        if how == "lookup":
            return StepChoice(RoundKind.LOOKUP, graph_t("verify", 1 + k, 1), [guess[:k]])
        return StepChoice(RoundKind.DRAFT, graph_t("verify", k + 1, 1), [NONE], k=k)


def play(gen, monkeypatch, script) -> None:
    """Every request of gen plays `script` (the engine's policy is the generator's batch of one's
    policy() for the request, made per request, so each starts the script afresh)."""
    real = gen.one.policy
    monkeypatch.setattr(gen.one, "policy", lambda method, ngram, fixed=False: Scripted(script,
                                                                                      real(method, ngram, True)))


def _scripted_runs(gen, prompt) -> tuple[Counter, Counter]:
    """N // 2 seeded runs under the scripted policy: (counts of the first DEPTH tokens, summed
    metrics: plain_steps, lookup_rounds, pair_rounds, accepted, drafted)."""
    counts, sums = Counter(), Counter()
    for seed in range(N // 2):
        sp = SamplingParams(**PARAMS, seed=seed)
        toks = [e.token for e in gen.tokens(prompt, max_new_tokens=NEW, sampling=sp, ngram=1)]
        counts[tuple(toks[:DEPTH])] += 1
        m = gen.last_metrics
        sums.update(plain_steps=m.plain_steps, lookup_rounds=m.lookup_rounds, pair_rounds=m.pair_rounds,
                    accepted=m.accepted, drafted=m.drafted)
    return counts, sums


@pytest.mark.parametrize("script", [(("plain", 0), ("draft", 2), ("draft", 3)),
                                    (("draft", 1), ("plain", 0), ("draft", 3)),
                                    (("lookup", 3), ("lookup", 2), ("plain", 0))])
def test_sampling_stays_exact_when_rounds_mix_plain_steps_lookup_and_draft_lengths(gen, tiny_pair, exact,
                                                                                  monkeypatch, script):
    """The adaptive policy's rounds: a plain step takes the target's own choice; a lookup
    guess is kept when it equals that choice, like a draft's token; any k and proposer keep
    the rule exact."""
    wants_lookup = any(how == "lookup" for how, _ in script)
    prompt = PROMPT
    if wants_lookup:   # the prompt followed by the target's own greedy text: lookup guesses the target often likes
        prompt = PROMPT + [e.token for e in gen.tokens(PROMPT, max_new_tokens=40, method="plain")]
    want = exact_of(tree_of(tiny_pair[0], prompt)) if wants_lookup else exact
    play(gen, monkeypatch, script)
    counts, m = _scripted_runs(gen, prompt)
    plain, looked, accepted, proposed = m["plain_steps"], m["lookup_rounds"], m["accepted"], m["drafted"]
    assert plain >= N // 4 and (looked >= N // 4 if wants_lookup else looked == 0), (plain, looked)
    if wants_lookup:   # the check means something only if lookup guesses are both accepted and rejected
        assert 0.1 < accepted / proposed < 0.9, (accepted, proposed)
    fit = fit_of(want, counts)
    assert fit.passes and fit.outside_support == 0, fit


def test_sampling_stays_exact_with_pair_rounds(gen, tiny_pair, monkeypatch):
    """A pair round puts one guessed token in the second row of the target's decode graph
    (a quantized target's runs two rows) and verifies it like a guess of k = 1. The
    fp32 target's decode graph has one row, so here its verify graph stands in for a two-row
    decode graph (same rows, padded): the engine's pair path against the exact distribution.
    The engine runs "decode" through the one-row adapter (batch/one_row.py OneRowModel), which
    calls the runner's step, which looks the graph up in the runner's `graphs`; the engine
    sizes the call by the adapter's graph_tokens (2: a two-row decode graph) and offers pair
    rounds where its policy has has_pair."""
    prompt = PROMPT + [e.token for e in gen.tokens(PROMPT, max_new_tokens=40, method="plain")]
    want = exact_of(tree_of(tiny_pair[0], prompt))
    assert gen.one.engine.target.runner is gen.target and not gen.one.full.has_pair
    monkeypatch.setitem(gen.target.graphs, "decode", gen.target.graphs["verify"])
    monkeypatch.setitem(gen.one.engine.target.graph_tokens, "decode", 2)
    monkeypatch.setattr(gen.one.full, "has_pair", True)
    play(gen, monkeypatch, [("pair", 1), ("pair", 1), ("draft", 2)])
    counts, m = _scripted_runs(gen, prompt)
    paired, accepted, proposed = m["pair_rounds"], m["accepted"], m["drafted"]
    assert paired >= N // 6, paired                  # pair rounds ran (in rounds where a 1-gram guess exists)
    assert 0.1 < accepted / proposed < 0.9, (accepted, proposed)
    fit = fit_of(want, counts)
    assert fit.passes and fit.outside_support == 0, fit
