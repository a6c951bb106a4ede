"""A Hugging Face model id (`org/name`) resolves offline from the local Hugging Face cache
(HF_HUB_CACHE, or HF_HOME/hub), laid out as huggingface_hub lays it out; when it is not there
the error says how to get it there, and that specrt never downloads."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from specrt.errors import ModelSourceError
from specrt.export import sources
from tiny_models import make_tiny_model_dir

MODEL_ID = "specrt-test/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _fill_cache(hub: Path, model_dir: Path) -> Path:
    """hub/models--org--name/{blobs/<hash>, snapshots/<commit>/<file> -> ../../blobs/<hash>, refs/main}."""
    import hashlib

    repo = hub / ("models--" + MODEL_ID.replace("/", "--"))
    snap = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in model_dir.iterdir():
        digest = hashlib.sha256(f.read_bytes()).hexdigest()
        (repo / "blobs" / digest).write_bytes(f.read_bytes())
        (snap / f.name).symlink_to(Path("..", "..", "blobs", digest))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snap


@pytest.fixture(scope="module")
def cached(tmp_path_factory):
    """(HF_HOME folder, snapshot folder, the original model folder)."""
    root = tmp_path_factory.mktemp("hf")
    model = make_tiny_model_dir(root / "model", "llama")
    return root / "home", _fill_cache(root / "home" / "hub", model), model


def _resolve_in_subprocess(env_extra: dict) -> subprocess.CompletedProcess:
    """huggingface_hub reads HF_HOME / HF_HUB_CACHE when imported: a fresh interpreter sees them."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))} | env_extra
    code = f"from specrt.export.sources import _resolve; print(_resolve({MODEL_ID!r})[0])"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parents[2])


@pytest.mark.parametrize("variable", ["HF_HOME", "HF_HUB_CACHE"])
def test_a_model_id_resolves_to_its_cached_snapshot(cached, variable):
    home, snap, _ = cached
    out = _resolve_in_subprocess({variable: str(home if variable == "HF_HOME" else home / "hub")})
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()) == snap


def test_a_model_id_loads_the_same_model_as_its_folder(cached, monkeypatch):
    from huggingface_hub import constants

    home, snap, model = cached
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    by_id, by_dir = sources.load_source(MODEL_ID), sources.load_source(model)
    assert by_id.identity["model_id"] == MODEL_ID and by_id.identity["source"] == str(snap)
    assert by_id.identity["files"] == by_dir.identity["files"] and by_id.dims == by_dir.dims


def test_a_model_id_not_in_the_cache_says_how_to_get_it_there(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")     # a network call would fail differently, not silently
    with pytest.raises(ModelSourceError) as e:
        sources.load_source("HuggingFaceTB/SmolLM2-135M-Instruct")
    msg = str(e.value)
    assert "never downloads" in msg and "hf download HuggingFaceTB/SmolLM2-135M-Instruct" in msg
    assert str(tmp_path / "empty") in msg and "HF_HOME" in msg


@pytest.mark.parametrize("path", ["nope/../etc", "./missing-folder", "/abs/missing", "a/b/c"])
def test_paths_that_are_not_model_ids_are_missing_paths(path):
    with pytest.raises(ModelSourceError, match="does not exist"):
        sources.load_source(path)


def test_a_local_folder_wins_over_a_model_id_of_the_same_name(cached, tmp_path, monkeypatch):
    _, _, model = cached
    local = tmp_path / "specrt-test"
    local.mkdir()
    (local / "tiny-llama").symlink_to(model, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    loaded = sources.load_source(MODEL_ID)
    assert "model_id" not in loaded.identity and loaded.identity["source"] == str(model.resolve())
