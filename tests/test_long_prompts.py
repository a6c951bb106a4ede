"""benchmarks/long_prompts.py: the long-prompt file the benchmarks' --prompt-file takes (issue 28
measures prompts of 1k-2k tokens). It must load as a prompt file, give the held-out split the
benchmarks take, and keep each prompt near the length asked for."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from specrt.calibration.dataset import load_prompts, split

ROOT = Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location("long_prompts", ROOT / "benchmarks/long_prompts.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_file_loads_splits_and_keeps_each_prompt_near_its_length(tmp_path):
    mod = _module()
    out = tmp_path / "long.jsonl"
    # no tokenizer: about 4 characters a token
    assert mod.main(["--out", str(out), "--tokens", "300", "--count", "8", "--tokenizer", str(tmp_path / "none")]) == 0
    prompts = load_prompts(out)
    assert len(prompts) == 8 and len({p.text for p in prompts}) == 8
    assert len(split(prompts)[1]) == 2                                  # the benchmarks' held-out quarter
    for p in prompts:
        assert p.text.endswith(mod.ASK)
        body = len(p.text) - len(mod.ASK)
        assert 300 * 4 <= body <= 300 * 4 * 1.1 + 100, body             # at least the length, at most 10% over
    again = tmp_path / "again.jsonl"
    mod.main(["--out", str(again), "--tokens", "300", "--count", "8", "--tokenizer", str(tmp_path / "none")])
    assert again.read_text() == out.read_text()                        # the same file for a checkout
