"""Shared fixtures: tiny random models exported once per session, and the real default
engines (built by `make engines`; tests that need them fail with that instruction)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))
ROOT = TESTS.parent
REAL_ENGINES = Path(os.environ.get("SPECRT_ENGINES", ROOT / "artifacts" / "smollm2"))


@pytest.fixture(scope="session")
def real_engines() -> Path:
    if not (REAL_ENGINES / "manifest.json").exists():
        pytest.fail(f"no engines at {REAL_ENGINES}: run `make engines` first (the README's `make test` does)")
    return REAL_ENGINES


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    from tiny_models import make_pair
    return make_pair(tmp_path_factory.mktemp("pair"), target_layers=3, draft_layers=1, vocab_size=128)


def build_tiny(out: Path, target: Path, draft: str, **kw) -> Path:
    from specrt.config import BuildConfig
    from specrt.pipeline import build
    cfg = BuildConfig(target=str(target), out=str(out), draft=draft, max_context=kw.pop("max_context", 96),
                      prefill_chunk=kw.pop("prefill_chunk", 16), k=kw.pop("k", 3), **kw)
    return build(cfg, progress=False)


@pytest.fixture(scope="session")
def tiny_engines(tmp_path_factory, tiny_pair) -> Path:
    """A tiny llama target (3 layers) with a separate 1-layer draft, own caches."""
    target, draft = tiny_pair
    return build_tiny(tmp_path_factory.mktemp("eng") / "pair", target, str(draft))


@pytest.fixture(scope="session")
def tiny_self_engines(tmp_path_factory, tiny_pair) -> Path:
    """The tiny target with its dynamic-INT8 copy as draft (shared cache)."""
    target, _ = tiny_pair
    return build_tiny(tmp_path_factory.mktemp("eng") / "self", target, "int8")


@pytest.fixture(scope="session")
def tiny_truncated_engines(tmp_path_factory, tiny_pair) -> Path:
    """The tiny target with its own first 2 layers as draft: related but different
    distributions, so sampled drafts are both accepted and rejected."""
    target, _ = tiny_pair
    return build_tiny(tmp_path_factory.mktemp("eng") / "trunc", target, "truncate:2")
