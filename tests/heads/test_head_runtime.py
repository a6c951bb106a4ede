"""A trained draft head inside the batched engine (runtime/head.py, engine._draft_head): its
proposals change no token (greedy and seeded samples equal the engine without it, rows joining
and leaving), they are what the head computes from scratch over the row's whole sequence (its
cache keeps exactly the pairs of the target's own hidden states), and a head that does not fit
the folder is refused with the fix."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from specrt.errors import ConfigError, GraphFileError, ManifestError
from specrt.runtime import SamplingParams, open_batch
from specrt.runtime.head import HeadModel

PROMPTS = ["the cat sat on", "a b c d e f", "once upon a time there", "1 2 3 4", "hello world", "abc abc abc",
           "the the the", "x y z"]


def _forced(gen):
    """Every round drafts k (the tiny folder's measured costs decide otherwise at random)."""
    gen.engine.policy.fixed = True
    return gen


def _run(engines, head=None, rows=4, sampling=None, n=24, record=None):
    with open_batch(engines, max_num_seqs=rows, head=head) as gen:
        if head is not None:
            _forced(gen)
            if record is not None:
                draft = gen.engine._draft_head

                def recording(choice):
                    out = draft(choice)
                    record.extend((list(r.seq), list(p)) for r, p in zip(gen.engine.rows, out))
                    return out
                gen.engine._draft_head = recording
        outs = gen.generate_batch(PROMPTS, max_new_tokens=n, sampling=sampling)
        return [o.tokens for o in outs], dict(gen.engine.stats.choices)


def test_the_head_changes_no_token_greedy_or_sampled(tiny_head):
    engines, head = tiny_head
    plain, _ = _run(engines)
    with_head, choices = _run(engines, head)
    assert choices.get("draft", 0) > 0
    assert with_head == plain
    one_row, _ = _run(engines, head, rows=1)
    assert one_row == plain
    s = SamplingParams(temperature=0.9, seed=11)
    assert _run(engines, head, sampling=s)[0] == _run(engines, sampling=s)[0]


def _from_scratch(engines, head, seq, k):
    """The head's greedy guesses after `seq` computed afresh: the target's hidden states of the
    whole sequence (one prefill per chunk, a batch of one), every pair into an empty head cache
    in one call, then k - 1 one-pair steps."""
    with open_batch(engines, max_num_seqs=1) as gen:
        t = gen.engine.target
        feats, C = [], gen.engine.prefill_tokens
        ids = np.array(seq[:-1], np.int64)
        for s in range(0, len(ids), C):
            chunk = ids[s:s + C]
            t.step("prefill", chunk[None], np.array([s]), 0)
            feats.append(t.hidden[0, :len(chunk)].copy())
        F = np.concatenate(feats)
        h = HeadModel(head, rows=1, capacity=gen.engine.target.cache.capacity, vocab=gen.engine.vocab)
    L = len(F)
    logits, hid = h.step(h.fc(F)[None], np.array([seq[1:]], np.int64), np.array([0]), np.array([[L - 1]]))
    out, state = [], hid[:, L - 1:L]
    for j in range(k):
        if j:
            logits, state = h.step(state, np.array([[out[-1]]]), np.array([L + j - 1]), np.zeros((1, 1), np.int64))
        out.append(int(np.argmax(h.full_logits(logits[0]))))
    return out


def test_each_proposal_is_the_heads_guess_from_scratch(tiny_head):
    """The engine's guesses, round after round, rows joining and leaving, equal the head run afresh
    over each row's whole sequence. Keeping a pair of the head's own guesses in its cache (no
    rewind), or a target hidden state one position off, fails this."""
    engines, head = tiny_head
    record = []
    _run(engines, head, record=record)
    assert len(record) > 20
    for seq, proposal in record[::3]:
        if proposal:
            assert _from_scratch(engines, head, seq, len(proposal)) == proposal, seq


def test_a_head_that_does_not_fit_is_refused(tiny_head, tiny_batch_rows_engines, tmp_path):
    engines, head = tiny_head
    with pytest.raises(ConfigError, match="--hidden-layers 0,1"):
        open_batch(tiny_batch_rows_engines, head=head)
    bad = tmp_path / "h"
    shutil.copytree(head, bad)
    meta = json.loads((bad / "head.json").read_text())
    (bad / meta["files"]["head"]["file"]).write_bytes(b"x" + (bad / meta["files"]["head"]["file"]).read_bytes())
    with pytest.raises(GraphFileError, match="sha256"):
        open_batch(engines, head=bad)
    for edit, err in (({"files": {**meta["files"], "head": {"file": "../head.onnx", "sha256": "0"}}}, ManifestError),
                      ({"layers": [0]}, ManifestError), ({"format": "other"}, ManifestError),
                      ({"costs_ms": {}}, ManifestError)):
        d = tmp_path / f"e{len(list(tmp_path.iterdir()))}"
        shutil.copytree(head, d)
        (d / "head.json").write_text(json.dumps({**meta, **edit}))
        with pytest.raises(err):
            open_batch(engines, head=d)
    with pytest.raises(ConfigError, match="head.json"):
        open_batch(engines, head=tmp_path)


def test_a_grammar_that_allows_none_of_the_heads_tokens_ends_the_guess_not_the_request(tiny_head):
    """The head proposes from its draft vocabulary only; where a row's grammar allows none of
    those tokens (digits outside the tiny head's 64), it stops guessing for that row: the answer
    is the one without the head, never a failed request."""
    engines, head = tiny_head
    vm = set(np.load(head / "vocab_map.npy").tolist())
    structured = {"regex": "[0-9]{6}[a-l]{6}"}
    outs = {}
    for name, h in (("plain", None), ("head", head)):
        with open_batch(engines, max_num_seqs=2, head=h) as gen:
            if h is not None:
                _forced(gen)
            outs[name] = [c.tokens for c in gen.generate_batch(PROMPTS[:4], max_new_tokens=16, structured=structured)]
            if h is not None:
                assert gen.engine.stats.choices.get("draft", 0) > 0
    assert outs["head"] == outs["plain"]
    assert any(t not in vm for toks in outs["plain"] for t in toks)      # the grammar forced tokens the head lacks


def test_samples_forked_from_one_prompt_and_the_single_stream_keep_their_answers(tiny_head):
    """n samples of one prompt (its prefill copied into a row per sample, the kept hidden states
    with it) and SpeculativeGenerator(head=) (a batch of one that switches policy per request)
    give the answers the engine gives without the head."""
    from specrt.runtime import SpeculativeGenerator
    engines, head = tiny_head
    s = SamplingParams(temperature=0.8, seed=3)
    outs = {}
    for name, h in (("plain", None), ("head", head)):
        with open_batch(engines, max_num_seqs=4, head=h) as gen:
            if h is not None:
                _forced(gen)
            outs[name] = [c.tokens for c in gen.generate_n(PROMPTS[2], 3, max_new_tokens=20, sampling=s)]
    assert outs["head"] == outs["plain"]
    plain = SpeculativeGenerator(engines)
    with_head = SpeculativeGenerator(engines, head=head)
    for p in PROMPTS[:4]:
        want = plain.generate(p, max_new_tokens=20, method="plain").tokens
        for method in ("lookup", "speculative", "plain", "speculative"):    # the policy changes between requests
            assert with_head.generate(p, max_new_tokens=20, method=method).tokens == want, (p, method)


def test_a_head_folder_with_a_linked_head_json_or_graphs_of_other_shapes_is_refused(tiny_head, tmp_path):
    engines, head = tiny_head
    linked = tmp_path / "linked"
    linked.mkdir()
    for f in head.iterdir():
        if f.is_file() and f.name != "head.json":
            shutil.copy(f, linked / f.name)
    (linked / "head.json").symlink_to(head / "head.json")
    with pytest.raises(ManifestError, match="symbolic link"):
        open_batch(engines, head=linked)
    other = tmp_path / "other"
    shutil.copytree(head, other)
    meta = json.loads((other / "head.json").read_text())
    meta["config"]["head_dim"] *= 2
    (other / "head.json").write_text(json.dumps(meta))
    with pytest.raises(GraphFileError, match="do not match head.json"):
        open_batch(engines, head=other)


def test_the_self_drafts_graph_returns_no_hidden_states_and_the_step_graph_must(tiny_head):
    """A folder built with --hidden-layers and the int8 self-draft (as the presets build): the
    target's step graph returns the hidden states a head reads, the draft's one-token graph
    none (its output once made ONNX Runtime refuse every draft call, and the build failed);
    the signature check lets only the draft graph go without, and after a draft call the
    model holds no hidden states of the target's."""
    import onnxruntime as ort

    from specrt import manifest as mf
    from specrt.runtime.backends.ort_batch import OrtBatchModel, _check_signature
    from specrt.runtime.backends.ort_cpu import io_dtypes, session_options
    engines, _ = tiny_head
    man = mf.load(engines)
    entry, root = man.batch, engines
    dt = io_dtypes(entry)
    assert {"step", "draft"} <= set(entry.graphs)
    sess = {g: ort.InferenceSession(str(root / entry.graphs[g].file), session_options(2),
                                    providers=["CPUExecutionProvider"]) for g in ("step", "draft")}
    outs = {g: {o.name for o in s.get_outputs()} for g, s in sess.items()}
    assert entry.io["hidden_states"] in outs["step"] and entry.io["hidden_states"] not in outs["draft"]
    cap = man.shapes.kv_capacity
    _check_signature(sess["draft"], root / "draft", entry, dt, cap, hidden_optional=True)
    _check_signature(sess["step"], root / "step", entry, dt, cap, hidden_optional=True)
    with pytest.raises(GraphFileError, match="missing"):
        _check_signature(sess["draft"], root / "draft", entry, dt, cap)

    target = OrtBatchModel(root, entry, man.shapes, rows=2, graphs=tuple(g for g in ("step", "prefill")
                                                                       if g in entry.graphs))
    draft = OrtBatchModel(root, entry, man.shapes, rows=2, graphs=("draft",), cache=target.cache, serves="draft",
                          min_rows=1)
    toks, starts = np.array([[5], [7]], np.int64), np.array([3, 4], np.int64)
    target.step("step", toks, starts)
    assert target.hidden.shape == (2, 1, target.hidden_width)
    draft.step("decode", toks, starts)
    assert draft.hidden is None
