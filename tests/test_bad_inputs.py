"""Bad inputs: every one ends in a typed `specrt.errors` exception whose message says
what to do, never in a traceback from deep inside ONNX Runtime, torch or transformers.

Cases (the issue's list): draft/target tokenizers that differ (at build and at load),
a prompt longer than the maximum context, generation reaching the maximum context
(stops cleanly and says why), missing or corrupt graph / weight / tokenizer files, a
manifest written by another version or for another device, invalid sampling
parameters; plus the CLI's handling of them and model-source errors.

Every check asserts the *exact* error class (`type(e) is X`): a test that catches
`pytest.raises(SpecrtError)` still fails on a bare RuntimeError/ValueError/...
because those propagate. Engines are the session fixtures from conftest, copied into
`tmp_path` before being damaged.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from bad_input_helpers import copy_engines, edit_manifest, expect, prompt_of, tokens_of
from conftest import build_tiny
from tiny_models import EOS_ID, make_pickled_only_dir, make_tiny_model_dir

from specrt import errors
from specrt.errors import (
    ContextLengthError,
    GraphFileError,
    ManifestError,
    ModelSourceError,
    SamplingParamsError,
    SpecrtError,
    TokenizerMismatchError,
)
from specrt.runtime import SamplingParams, SpeculativeGenerator

MAX_CONTEXT = 96   # conftest.build_tiny's default
BUILT_K = 3        # conftest.build_tiny's default


@pytest.fixture(scope="module")
def gen(tiny_engines) -> SpeculativeGenerator:
    """A healthy generator over the (read-only) session engines."""
    return SpeculativeGenerator(tiny_engines)


def test_error_classes_all_derive_from_specrt_error():
    for name in ("ModelSourceError", "ExportError", "ParityError", "ManifestError", "GraphFileError",
                 "TokenizerMismatchError", "ContextLengthError", "SamplingParamsError"):
        assert issubclass(getattr(errors, name), SpecrtError), name
    assert issubclass(GraphFileError, ManifestError)




# --------------------------------------------------------------------------- 1-2. tokenizers differ


def test_build_with_a_draft_of_another_vocabulary_raises_tokenizer_mismatch_and_keeps_the_previous_build(
        tiny_pair, tiny_engines, tmp_path):
    target, _ = tiny_pair                       # vocab 128
    draft = make_tiny_model_dir(tmp_path / "draft160", layers=1, vocab_size=160, seed=1)
    # a previous good build at `out` (a copy of the session build: what building it again would give)
    out = copy_engines(tiny_engines, tmp_path, "out")
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}

    msg = expect(TokenizerMismatchError, build_tiny, out, target, str(draft))
    assert "128" in msg and "160" in msg
    assert "same model family" in msg           # what to do: pick a draft that shares the tokenizer

    after = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert after == before, "a failed rebuild modified the previous build"
    SpeculativeGenerator(out)                   # and it still loads


def test_failed_build_into_a_fresh_folder_leaves_no_output_folder(tiny_pair, tmp_path):
    target, _ = tiny_pair
    draft = make_tiny_model_dir(tmp_path / "draft160", layers=1, vocab_size=160, seed=1)
    out = tmp_path / "fresh"
    expect(TokenizerMismatchError, build_tiny, out, target, str(draft))
    assert not out.exists(), f"half-built output left at {out}: {list(out.rglob('*'))}"


def test_build_after_the_runtime_was_used_in_the_same_process_still_works(tiny_pair, tiny_engines, tmp_path):
    # regression: the runtime creates ORT's process-wide thread pool; the build's parity
    # sessions used to demand per-session pools and died with a raw ORT RuntimeError
    SpeculativeGenerator(tiny_engines)
    target, _ = tiny_pair
    out = build_tiny(tmp_path / "plain", target, "none")
    assert (out / "manifest.json").exists()


def test_engines_whose_draft_vocabulary_differs_raise_tokenizer_mismatch_at_load(tiny_engines, tmp_path):
    d = copy_engines(tiny_engines, tmp_path)
    edit_manifest(d, lambda m: m["models"]["draft"]["dims"].__setitem__("vocab", 160))
    msg = expect(TokenizerMismatchError, SpeculativeGenerator, d)
    assert "160" in msg and "128" in msg
    assert "same model family" in msg


def test_engines_whose_draft_was_built_from_another_tokenizer_raise_tokenizer_mismatch_at_load(
        tiny_engines, tmp_path):
    d = copy_engines(tiny_engines, tmp_path)
    edit_manifest(d, lambda m: m["models"]["draft"]["source"].__setitem__("tokenizer_sha256", "0" * 64))
    msg = expect(TokenizerMismatchError, SpeculativeGenerator, d)
    assert "shared tokenizer" in msg


def test_prompt_ids_outside_the_vocabulary_raise_tokenizer_mismatch(gen):
    msg = expect(TokenizerMismatchError, gen.generate, [5, 6, 128], max_new_tokens=2)
    assert "[0, 128)" in msg
    expect(TokenizerMismatchError, gen.generate, [5, -1, 6], max_new_tokens=2)


# --------------------------------------------------------------------------- 3. prompt too long / empty


@pytest.mark.parametrize("method", ["speculative", "plain"])
def test_prompt_longer_than_the_maximum_context_raises_context_length_error(gen, method):
    prompt = list(range(5)) * 30                # 150 tokens > 96
    msg = expect(ContextLengthError, gen.generate, prompt, method=method)
    assert "150" in msg and str(MAX_CONTEXT) in msg
    assert "--max-context" in msg               # what to do
    assert "shorten the prompt" in msg


def test_prompt_exactly_the_maximum_context_raises_context_length_error(gen):
    msg = expect(ContextLengthError, gen.generate, prompt_of(MAX_CONTEXT), max_new_tokens=4)
    assert "--max-context" in msg


def test_text_prompt_longer_than_the_maximum_context_raises_context_length_error(gen):
    msg = expect(ContextLengthError, gen.generate, "abcdefghij" * 20, max_new_tokens=4)  # 200 char tokens
    assert "--max-context" in msg


@pytest.mark.parametrize("prompt", [[], ""], ids=["no-ids", "empty-text"])
def test_empty_prompt_raises_context_length_error(gen, prompt):
    msg = expect(ContextLengthError, gen.generate, prompt, max_new_tokens=4)
    assert "empty" in msg and "at least one token" in msg


# --------------------------------------------------------------------------- 4. reaching the max context


@pytest.mark.parametrize("sampling", [None, SamplingParams(temperature=0.8, top_k=20, seed=0)],
                         ids=["greedy", "sampled"])
@pytest.mark.parametrize("method", ["plain", "speculative"])
def test_generation_reaching_the_maximum_context_stops_cleanly_at_it(gen, method, sampling):
    before = tokens_of(gen, prompt_of(10), max_new_tokens=12, method=method)
    prompt = prompt_of(90)
    toks = tokens_of(gen, prompt, max_new_tokens=50, method=method, sampling=sampling)  # no EOS stop here
    assert len(toks) == MAX_CONTEXT - len(prompt)
    assert len(prompt) + len(toks) <= MAX_CONTEXT
    assert gen.last_metrics.finish_reason == "max_context"
    # the generator is reusable afterwards (caches rewound): the same tokens as before the run
    assert tokens_of(gen, prompt_of(10), max_new_tokens=12, method=method) == before


@pytest.mark.parametrize("method", ["plain", "speculative"])
def test_generate_reaching_the_maximum_context_says_why_and_what_to_do(gen, method):
    # greedy is deterministic: pick a 90-token prompt whose 6 continuation tokens contain no EOS
    for salt in range(20):
        prompt = prompt_of(90, salt)
        if EOS_ID not in tokens_of(gen, prompt, max_new_tokens=50, method="plain"):
            break
    else:
        pytest.fail("every candidate prompt hit EOS before the maximum context")
    c = gen.generate(prompt, max_new_tokens=50, method=method)
    print(f"\n[Completion.message] {c.message}")
    assert c.finish_reason == "max_context"
    assert c.prompt_tokens == 90
    assert len(prompt) + len(c.tokens) <= MAX_CONTEXT
    assert len(c.tokens) == MAX_CONTEXT - 90
    assert str(MAX_CONTEXT) in c.message
    assert "rebuild" in c.message and "--max-context" in c.message


def test_generation_fitting_exactly_in_the_context_finishes_with_length(gen):
    prompt = prompt_of(90)
    toks = tokens_of(gen, prompt, max_new_tokens=MAX_CONTEXT - 90, method="plain")
    assert len(toks) == MAX_CONTEXT - 90
    assert gen.last_metrics.finish_reason == "length"


# --------------------------------------------------------------------------- 8. invalid sampling parameters


@pytest.mark.parametrize("kw,field", [
    ({"temperature": -1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -3}, "top_k"),
    ({"top_k": 2.5}, "top_k"),
    ({"seed": -1}, "seed"),
])
def test_invalid_sampling_params_raise_sampling_params_error(kw, field):
    msg = expect(SamplingParamsError, SamplingParams, **kw)
    assert f"{field}=" in msg
    assert "pass" in msg or "use" in msg        # what to do


@pytest.mark.parametrize("value", [0, -1, 2.5, None])
def test_invalid_max_new_tokens_raises_sampling_params_error(gen, value):
    msg = expect(SamplingParamsError, gen.generate, prompt_of(8), max_new_tokens=value)
    assert "max_new_tokens" in msg and ">= 1" in msg


def test_invalid_max_new_tokens_raises_from_the_token_iterator_too(gen):
    expect(SamplingParamsError, lambda: next(gen.tokens(prompt_of(8), max_new_tokens=0)))


def test_k_larger_than_the_built_k_raises_sampling_params_error(tiny_engines):
    msg = expect(SamplingParamsError, SpeculativeGenerator, tiny_engines, k=99)
    assert "k=99" in msg and f"k={BUILT_K}" in msg and "--k 99" in msg and "rebuild" in msg


def test_k_below_one_raises_sampling_params_error(tiny_engines):
    msg = expect(SamplingParamsError, SpeculativeGenerator, tiny_engines, k=0)
    assert "k=0" in msg and f"[1, {BUILT_K}]" in msg


def test_k_below_one_message_does_not_suggest_rebuilding_with_it(tiny_engines):
    msg = expect(SamplingParamsError, SpeculativeGenerator, tiny_engines, k=0)
    assert "--k 0" not in msg


def test_non_integer_k_raises_sampling_params_error(tiny_engines):
    expect(SamplingParamsError, SpeculativeGenerator, tiny_engines, k="abc")


def test_unknown_memory_mode_raises_sampling_params_error(tiny_engines):
    msg = expect(SamplingParamsError, SpeculativeGenerator, tiny_engines, memory="tiny")
    assert "memory='tiny'" in msg and "fast" in msg and "shared" in msg


def test_unknown_method_raises_sampling_params_error(gen):
    msg = expect(SamplingParamsError, gen.generate, prompt_of(8), max_new_tokens=2, method="beam")
    assert "method='beam'" in msg and "speculative" in msg and "plain" in msg


def test_invalid_sampling_params_through_generate_raise_before_any_work(gen):
    # the dataclass refuses them at construction, so the public API never sees them
    expect(SamplingParamsError, lambda: gen.generate(prompt_of(8), sampling=SamplingParams(temperature=-1)))


# --------------------------------------------------------------------------- 9. CLI


def _cli(argv, capsys) -> tuple[int, str, str]:
    from specrt.cli import main
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    print(f"\n[cli rc={rc}] {err.strip()}")
    return rc, out, err


@pytest.mark.parametrize("cmd", ["generate", "inspect", "bench"])
def test_cli_on_a_missing_engines_folder_exits_2_with_a_one_line_error(tmp_path, capsys, cmd):
    argv = [cmd, tmp_path / "no-engines"] + (["hello"] if cmd == "generate" else [])
    rc, out, err = _cli(argv, capsys)
    assert rc == 2
    assert err.startswith("specrt: error: ManifestError:")
    assert "specrt build" in err
    assert "Traceback" not in err and "Traceback" not in out


def test_cli_generate_with_a_prompt_too_long_exits_2_saying_max_context(tiny_engines, capsys):
    rc, _, err = _cli(["generate", tiny_engines, "abcdefghij" * 20, "--raw", "--max-new-tokens", "4"], capsys)
    assert rc == 2
    assert err.startswith("specrt: error: ContextLengthError:") and "--max-context" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("flag,value,field", [("--temperature", "-1", "temperature"), ("--top-p", "0", "top_p"),
                                              ("--top-k", "-3", "top_k"), ("--k", "99", "k")])
def test_cli_generate_with_invalid_sampling_flags_exits_2(tiny_engines, capsys, flag, value, field):
    rc, _, err = _cli(["generate", tiny_engines, "hi", "--raw", flag, value], capsys)
    assert rc == 2
    assert err.startswith("specrt: error: SamplingParamsError:") and f"{flag} {value}" in err   # flag words
    assert f"{field}=" not in err
    assert "Traceback" not in err


def test_cli_generate_reaching_the_maximum_context_says_so(tiny_engines, capsys):
    prompt = "abcdefghij" * 9                  # 90 character tokens
    rc, _, err = _cli(["generate", tiny_engines, prompt, "--raw", "--plain", "--max-new-tokens", "50"], capsys)
    assert rc == 0
    assert "finish: max_context" in err
    assert "maximum context" in err and "--max-context" in err


# --------------------------------------------------------------------------- 10. model sources


def test_model_source_with_only_pickled_weights_raises_model_source_error(tmp_path):
    from specrt.export.sources import load_source
    d = make_pickled_only_dir(tmp_path / "pickled")
    msg = expect(ModelSourceError, load_source, d)
    assert "safetensors" in msg and "pytorch_model.bin" in msg and "never unpickles" in msg


def test_model_source_that_does_not_exist_raises_model_source_error(tmp_path):
    from specrt.export.sources import load_source
    msg = expect(ModelSourceError, load_source, tmp_path / "no-such-model")
    assert "does not exist" in msg and ".gguf" in msg


def test_model_source_file_that_is_not_gguf_raises_model_source_error(tmp_path):
    from specrt.export.sources import load_source
    f = tmp_path / "model.bin"
    f.write_bytes(b"\x00" * 16)
    msg = expect(ModelSourceError, load_source, f)
    assert "GGUF" in msg and "safetensors" in msg


def test_model_source_without_config_raises_model_source_error(tmp_path):
    from specrt.export.sources import load_source
    (tmp_path / "m").mkdir()
    msg = expect(ModelSourceError, load_source, tmp_path / "m")
    assert "config.json" in msg


def _safetensors(path: Path) -> None:
    import numpy as np
    from safetensors.numpy import save_file
    save_file({"w": np.zeros((2, 2), np.float32)}, str(path))


def test_model_source_with_an_unsupported_architecture_lists_the_supported_ones(tmp_path):
    from specrt.export.sources import load_source
    d = tmp_path / "bert"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    _safetensors(d / "model.safetensors")
    msg = expect(ModelSourceError, load_source, d)
    assert "'bert'" in msg and "not supported" in msg
    for supported in ("llama", "mistral", "qwen2", "gpt2"):
        assert supported in msg


def test_model_source_with_corrupt_safetensors_raises_model_source_error(tiny_pair, tmp_path):
    from specrt.export.sources import load_source
    target, _ = tiny_pair
    d = tmp_path / "corrupt"
    shutil.copytree(target, d)
    (d / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage" + b"\x00" * 64)
    msg = expect(ModelSourceError, load_source, d)
    assert "could not load" in msg


def test_build_with_a_draft_path_that_does_not_exist_raises_specrt_error(tiny_pair, tmp_path):
    target, _ = tiny_pair
    msg = expect(SpecrtError, build_tiny, tmp_path / "out", target, str(tmp_path / "no-draft"))
    assert "neither a known kind nor an existing path" in msg and "int8" in msg
    assert not (tmp_path / "out").exists()



def test_an_int8_draft_that_disagrees_with_its_target_fails_the_build(tiny_pair, tmp_path, monkeypatch):
    from specrt.builder.gates import measure
    from specrt.errors import ParityError

    real = measure.draft_agreement
    monkeypatch.setattr(measure, "draft_agreement",
                        lambda *a, **k: {**real(*a, **k), "top1_agreement": 0.1})
    msg = expect(ParityError, build_tiny, tmp_path / "bad", tiny_pair[0], "int8")
    assert "10.0%" in msg and "--draft" in msg
    assert not (tmp_path / "bad").exists()
