"""Trained draft heads (issue 29, specrt/heads/): the EAGLE-style head's training-time test is
what its exported graph computes step by step over its own cache; `specrt train-draft`'s
recipe end to end on a tiny engine folder (answers, teacher, training, export, the ONNX gate,
acceptance), resumable and seeded."""
from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest
import torch

from specrt.heads.export import export_head
from specrt.heads.model import EagleHead, HeadConfig

CFG = HeadConfig(hidden=32, n_feats=3, heads=4, kv_heads=2, head_dim=8, intermediate=48, draft_vocab=20,
                 rope_theta=10000.0, eps=1e-5)


@pytest.fixture(scope="module")
def random_head(tmp_path_factory):
    torch.manual_seed(0)
    head = EagleHead(CFG, torch.randn(50, 32), torch.arange(0, 40, 2)).eval()
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return head, export_head(head, tmp_path_factory.mktemp("head"))


def _sessions(paths):
    from specrt.runtime.backends.ort_cpu import session_options
    return tuple(ort.InferenceSession(str(paths[g]), session_options(2), providers=["CPUExecutionProvider"])
                 for g in ("fc", "head"))


def _empty():
    return np.zeros((1, CFG.kv_heads, 0, CFG.head_dim), np.float32)


def test_each_unrolled_training_step_is_the_exported_head_drafting_over_its_cache(random_head):
    """Anchor a: the real pairs 0..a-1 go into the head's cache in one call; draft step j then feeds
    one pair (the previous step's hidden_out, the token after it) and appends its K/V. Step j's
    logits at pair a+j-1 equal the training-time test's step j at that pair: what the head trains
    on is what it will see. A mask in `unrolled` that let a draft step see one pair too many or
    too few fails this."""
    head, paths = random_head
    fc, hs = _sessions(paths)
    L = 14
    g = torch.Generator().manual_seed(1)
    feats, toks = torch.randn(1, L, 96, generator=g), torch.randint(0, 50, (1, L), generator=g)
    with torch.no_grad():
        ref = [x[0].numpy() for x in head.unrolled(feats, toks, 4)]
    h = fc.run(None, {"features": feats[0, :L - 1].numpy()})[0][None]
    np.testing.assert_allclose(h[0], head.fc(feats[0, :L - 1]).detach().numpy(), atol=1e-5)
    for a in (1, 4, 8):
        _, _, K, V = hs.run(None, {"hidden": h[:, :a], "input_ids": toks[:, 1:a + 1].numpy(), "past_len": [0],
                                   "logit_pos": [[a - 1]], "past_k": _empty(), "past_v": _empty()})
        hid, tok = h[:, a:a + 1], toks[:, a + 1:a + 2].numpy()
        for j in range(4):
            lg, ho, k, v = hs.run(None, {"hidden": hid, "input_ids": tok, "past_len": [K.shape[2]],
                                         "logit_pos": [[0]], "past_k": K, "past_v": V})
            np.testing.assert_allclose(lg[0, 0], ref[j][a + j], atol=1e-4, err_msg=f"anchor {a}, draft step {j + 1}")
            K, V = np.concatenate([K, k], 2), np.concatenate([V, v], 2)
            hid, tok = ho, toks[:, a + j + 2:a + j + 3].numpy()


def test_rows_of_one_head_call_are_independent_and_padding_is_not_read(random_head):
    """Two rows at different cache lengths in one call give each row's result alone (the batch
    contract of export/batch.py); cache positions past a row's length hold junk that must not count."""
    head, paths = random_head
    _, hs = _sessions(paths)
    rng = np.random.default_rng(0)
    K = rng.standard_normal((2, CFG.kv_heads, 6, CFG.head_dim)).astype(np.float32)
    V = rng.standard_normal((2, CFG.kv_heads, 6, CFG.head_dim)).astype(np.float32)
    hid = rng.standard_normal((2, 3, 32)).astype(np.float32)
    ids = np.array([[1, 2, 3], [4, 5, 6]])
    both = hs.run(None, {"hidden": hid, "input_ids": ids, "past_len": [2, 6], "logit_pos": [[0, 2], [1, 2]],
                         "past_k": K, "past_v": V})
    for b, (n, pos) in enumerate(((2, [0, 2]), (6, [1, 2]))):
        alone = hs.run(None, {"hidden": hid[b:b + 1], "input_ids": ids[b:b + 1], "past_len": [n], "logit_pos": [pos],
                              "past_k": K[b:b + 1, :, :n], "past_v": V[b:b + 1, :, :n]})
        for name, x, y in zip(("logits", "hidden_out", "new_k", "new_v"), both, alone):
            np.testing.assert_allclose(x[b], y[0], atol=1e-5, err_msg=f"row {b}: {name}")


@pytest.fixture(scope="module")
def recipe_run(tiny_head):
    from specrt.heads.recipe import Recipe
    engines, out = tiny_head
    return Recipe(engines=engines, out=out), json.loads((out / "head.json").read_text())


def test_train_draft_recipe_end_to_end_on_a_tiny_folder(recipe_run):
    r, report = recipe_run
    saved = report
    assert saved["layers"] == [0, 1] and saved["config"]["n_feats"] == 2      # 3 layers: all but the last
    import hashlib
    for f in saved["files"].values():
        assert hashlib.sha256((r.out / f["file"]).read_bytes()).hexdigest() == f["sha256"]
    assert saved["gate"]["draft_steps_checked"] > 0 and saved["gate"]["max_abs_logit_diff"] <= saved["gate"]["tolerance"]
    acc = saved["acceptance"]
    assert acc["held_out_prompts"] > 0 and acc["rounds"] > 0 and len(acc["alpha"]) == 3
    assert 1.0 <= acc["tokens_per_round"] <= 4.0
    assert set(saved["costs_ms"]["draft"]) == {"1", "2", "4", "8"}          # the build's row counts
    assert all(v > 0 for v in saved["costs_ms"]["draft"].values())
    rec = saved["recipe"]
    assert rec["train_tokens"] > 0 and rec["batches"] > 0 and rec["draft_vocab"] <= 64
    vm = np.load(r.out / "vocab_map.npy")
    assert list(vm) == sorted(set(vm.tolist())) and len(vm) == rec["draft_vocab"]


def test_training_is_seeded_and_learns(recipe_run):
    """The same shards and seed give the same losses; the loss falls; a head trained on the
    folder's answers accepts more of them than an untrained one, and far more than the same head
    whose vocabulary map is off by one (a draft index mapped to the wrong target token)."""
    from specrt.heads.train import draft_vocabulary, eagle_acceptance, load_shards, train_eagle
    from specrt.heads.recipe import head_config
    r, report = recipe_run
    shards = load_shards(sorted((r.out / "work").glob("teacher-24-*/*.npz")))
    assert shards
    vm = torch.from_numpy(draft_vocabulary(shards, 64))
    embed = torch.randn(int(max(s["top_id"].max() for s in shards)) + 1 + 8, 64, generator=torch.Generator().manual_seed(0))
    from transformers import AutoConfig
    cfg = head_config(AutoConfig.from_pretrained(json.loads((r.out / "head.json").read_text())["source"]), 2, len(vm))

    def trained():
        torch.manual_seed(123)
        head = EagleHead(cfg, embed, vm)
        res = train_eagle(head, shards, epochs=30, steps=2, lr=1e-2, seed=5, progress=False)
        return head, res.losses

    (h1, l1), (_, l2) = trained(), trained()
    assert l1 == l2
    assert np.mean(l1[-3:]) < np.mean(l1[:3])
    good = eagle_acceptance(h1, shards, 2)["tokens_per_round"]
    torch.manual_seed(123)
    untrained = eagle_acceptance(EagleHead(cfg, embed, vm), shards, 2)["tokens_per_round"]
    h1.vocab_map.add_(1)                 # the vocabulary map off by one
    broken = eagle_acceptance(h1, shards, 2)["tokens_per_round"]
    assert good > untrained + 0.3 and good > broken + 0.3, (good, untrained, broken)   # measured: 1.69, 1.02, 1.00


def test_a_rerun_reuses_every_stage_on_disk(recipe_run):
    r, _ = recipe_run
    work = r.out / "work"
    stamps = {p: p.stat().st_mtime_ns for p in work.rglob("*") if p.is_file()}
    from specrt.heads import data
    rows = data.answer(r.engines, ["never asked"], next(work.glob("answers-*.jsonl")), samples=(0.0,), seed=0,
                       max_new_tokens=4)
    assert len(rows) > 1                 # read back, not regenerated for the new prompt
    assert stamps == {p: p.stat().st_mtime_ns for p in work.rglob("*") if p.is_file()}


def test_train_draft_refuses_what_could_not_run_before_any_work(tiny_head, tiny_batch_rows_engines, tmp_path):
    """A folder without hidden states, --layers other than the folder's, and a work folder made
    for other answers are refused at once, with the fix, not after hours of training."""
    from specrt.errors import ConfigError
    from specrt.heads.recipe import Recipe, run
    engines, head = tiny_head
    with pytest.raises(ConfigError, match="--hidden-layers"):
        run(Recipe(engines=tiny_batch_rows_engines, out=tmp_path / "a"), progress=False)
    with pytest.raises(ConfigError, match="--layers 0"):
        run(Recipe(engines=engines, out=tmp_path / "b", layers=(0,)), progress=False)
    import shutil
    shutil.copytree(head / "work", tmp_path / "c" / "work")
    with pytest.raises(ConfigError, match="max_new_tokens"):
        run(Recipe(engines=engines, out=tmp_path / "c", max_prompts=24, max_new_tokens=25, draft_vocab=64, steps=3,
                   seed=0), progress=False)
