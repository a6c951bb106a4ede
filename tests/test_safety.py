"""No silent wrong output, no lost data (issue 6).

One instance used concurrently raises `ConcurrentUseError` at once and the open stream
finishes correctly; damage of the same size is caught by the default integrity check;
`build --out` never deletes what it did not create and fails before the long work;
every CLI failure is one `specrt: error:` line. Each test here failed (or crashed)
before the fix it covers.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from bad_input_helpers import copy_engines, edit_manifest, expect, prompt_of
from conftest import build_tiny as _build_tiny

from specrt import cli
from specrt.errors import (
    ConcurrentUseError,
    ConfigError,
    GraphFileError,
    ManifestError,
    PromptError,
    SamplingParamsError,
)
from specrt.runtime import SpeculativeGenerator
from specrt.runtime.backends.ort_cpu import configure_threads

N = 24   # tokens per generation: several speculative iterations


def build_tiny(out, target, draft, force=False):
    """conftest.build_tiny, with build's force flag."""
    if not force:
        return _build_tiny(out, target, draft)
    from specrt.builder.config import BuildConfig
    from specrt.builder.pipeline import build
    return build(BuildConfig(target=str(target), out=str(out), draft=draft, max_context=96, prefill_chunk=16, k=3),
                 progress=False, force=True)


@pytest.fixture(scope="module")
def gen(tiny_engines) -> SpeculativeGenerator:
    return SpeculativeGenerator(tiny_engines)


def solo(gen, prompt, method):
    return [e.token for e in gen.tokens(prompt, max_new_tokens=N, method=method)]


# --------------------------------------------------------------------------- one instance, two users


@pytest.mark.parametrize("method", ["speculative", "plain"])
def test_interleaved_streams_raise_at_once_and_the_open_stream_stays_correct(gen, method):
    a_prompt, b_prompt = prompt_of(9, salt=1), prompt_of(13, salt=2)
    want_a, want_b = solo(gen, a_prompt, method), solo(gen, b_prompt, method)
    a = gen.tokens(a_prompt, max_new_tokens=N, method=method)
    got_a = [next(a).token for _ in range(3)]
    b = gen.tokens(b_prompt, max_new_tokens=N, method=method)
    msg = expect(ConcurrentUseError, next, b)
    assert "close" in msg and "own SpeculativeGenerator" in msg
    got_a += [e.token for e in a]
    assert got_a == want_a
    assert solo(gen, b_prompt, method) == want_b      # the instance is free again


def test_interleaved_text_streams_raise_and_closing_the_first_frees_the_instance(gen):
    want = gen.generate(prompt_of(7), max_new_tokens=N).tokens
    a = gen.stream(prompt_of(11), max_new_tokens=N)
    next(a)
    expect(ConcurrentUseError, next, gen.stream(prompt_of(7), max_new_tokens=N))
    a.close()
    assert gen.generate(prompt_of(7), max_new_tokens=N).tokens == want


def test_an_abandoned_stream_releases_the_instance(gen):
    want = solo(gen, prompt_of(5), "speculative")
    a = gen.tokens(prompt_of(11), max_new_tokens=N)
    next(a)
    del a
    assert solo(gen, prompt_of(5), "speculative") == want


def test_a_second_thread_gets_concurrent_use_error_while_the_first_thread_generates(gen):
    prompt = prompt_of(10, salt=3)
    want = solo(gen, prompt, "speculative")
    started, go_on, result = threading.Event(), threading.Event(), {}

    def first():
        it = gen.tokens(prompt, max_new_tokens=N)
        toks = [next(it).token]
        started.set()
        go_on.wait(30)
        result["a"] = toks + [e.token for e in it]

    t = threading.Thread(target=first)
    t.start()
    assert started.wait(30)
    try:
        expect(ConcurrentUseError, gen.generate, prompt_of(4), max_new_tokens=4)
    finally:
        go_on.set()
        t.join(60)
    assert result["a"] == want


def test_threads_racing_on_one_instance_get_their_solo_output_or_an_error_never_wrong_tokens(gen):
    prompts = [prompt_of(6 + i, salt=i) for i in range(4)]
    want = [solo(gen, p, "speculative") for p in prompts]
    outcomes = []

    def worker(i):
        for _ in range(3):
            try:
                outcomes.append((i, [e.token for e in gen.tokens(prompts[i], max_new_tokens=N)]))
            except ConcurrentUseError:
                outcomes.append((i, None))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(outcomes) == 12
    assert any(toks is not None for _, toks in outcomes)
    for i, toks in outcomes:
        assert toks is None or toks == want[i], f"thread {i} got wrong tokens"


# --------------------------------------------------------------------------- API inputs


def test_a_single_stop_string_is_one_stop_not_a_set_of_characters(gen):
    full = gen.generate(prompt_of(8), max_new_tokens=N, method="plain").text
    assert len(full) >= 6
    stop = full[3:6]
    out = gen.generate(prompt_of(8), max_new_tokens=N, method="plain", stop=stop)
    assert out.finish_reason == "stop" and out.text == full[:full.find(stop)]
    assert gen.generate(prompt_of(8), max_new_tokens=N, method="plain", stop=["\x00never"]).text == full


@pytest.mark.parametrize("prompt", [b"hello", bytearray(b"hi"), ["a", "b"], [1.5, 2.0], 42, [True, 7]])
def test_prompts_that_are_neither_text_nor_token_ids_raise_prompt_error(gen, prompt):
    expect(PromptError, gen.generate, prompt, max_new_tokens=2)


def test_text_that_is_not_valid_utf8_raises_prompt_error(gen):
    bad = b"caf\xff".decode("utf-8", "surrogateescape")   # what sys.argv holds for such bytes
    assert "UTF-8" in expect(PromptError, gen.generate, bad, max_new_tokens=2)


def test_numpy_token_ids_are_accepted(gen):
    np = pytest.importorskip("numpy")
    ids = prompt_of(6)
    assert solo(gen, np.array(ids), "plain") == solo(gen, ids, "plain")


@pytest.mark.parametrize("threads", [-1, 0, "2", 2.0, True])
def test_invalid_thread_counts_raise_config_error(tiny_engines, threads):
    expect(ConfigError, SpeculativeGenerator, tiny_engines, threads=threads)


def test_a_thread_count_other_than_the_process_pool_raises_instead_of_silently_using_the_pool(tiny_engines):
    configure_threads(2)                     # the pool every other test uses
    msg = expect(ConfigError, SpeculativeGenerator, tiny_engines, threads=1)
    assert "threads=2" in msg


# --------------------------------------------------------------------------- integrity by default


def _zero_block(path: Path, fraction: float = 0.5, size: int = 4096) -> None:
    with open(path, "r+b") as f:
        f.seek(int(path.stat().st_size * fraction))
        f.write(b"\x00" * size)


def test_zeroed_block_inside_weights_is_detected_by_default(tiny_engines, tmp_path):
    d = copy_engines(tiny_engines, tmp_path)
    _zero_block(d / "target" / "weights.bin")
    msg = expect(GraphFileError, SpeculativeGenerator, d)
    assert "weights.bin" in msg and "sha256" in msg and "rebuild" in msg


def test_verify_none_skips_the_hashes_as_documented(tiny_engines, tmp_path):
    d = copy_engines(tiny_engines, tmp_path)
    _zero_block(d / "target" / "weights.bin")
    SpeculativeGenerator(d, verify="none")       # loads: the opt-out does what it says


def test_a_graph_copied_over_another_is_detected_by_default(tiny_self_engines, tmp_path):
    d = copy_engines(tiny_self_engines, tmp_path)
    shutil.copy(d / "draft" / "decode.onnx", d / "target" / "decode.onnx")
    msg = expect(GraphFileError, SpeculativeGenerator, d)
    assert "decode.onnx" in msg


def test_a_shuffled_tokenizer_vocabulary_is_detected_by_default(tiny_engines, tmp_path):
    d = copy_engines(tiny_engines, tmp_path)
    tok = json.loads((d / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    keys = list(vocab)
    values = [vocab[k] for k in keys]
    tok["model"]["vocab"] = dict(zip(keys, values[1:] + values[:1]))
    (d / "tokenizer.json").write_text(json.dumps(tok))
    assert "tokenizer.json" in expect(GraphFileError, SpeculativeGenerator, d)


def test_unknown_verify_mode_raises_config_error(tiny_engines):
    expect(ConfigError, SpeculativeGenerator, tiny_engines, verify="quick")


# --------------------------------------------------------------------------- damaged manifests


@pytest.mark.parametrize("edit, words", [
    (lambda m: m["models"]["target"]["graphs"].pop("verify"), "verify"),
    (lambda m: m.__setitem__("models", [m["models"]["target"]]), "models"),
    (lambda m: m["models"]["target"]["weights"]["initializers"].__setitem__(
        next(iter(m["models"]["target"]["weights"]["initializers"])), [10 ** 12, 4, "<f4", [1]]), "initializer"),
    (lambda m: m["models"]["target"].__setitem__("dims", "big"), "dims"),
    (lambda m: m["models"]["target"]["dims"].__setitem__("vocab", -1), "vocab"),
])
def test_hand_damaged_manifest_fields_raise_manifest_error(tiny_engines, tmp_path, edit, words):
    d = copy_engines(tiny_engines, tmp_path)
    edit_manifest(d, edit)
    msg = expect(ManifestError, SpeculativeGenerator, d, memory="shared")
    assert words in msg and "rebuild" in msg


def test_a_manifest_that_is_a_folder_raises_manifest_error(tmp_path):
    (tmp_path / "eng" / "manifest.json").mkdir(parents=True)
    expect(ManifestError, SpeculativeGenerator, tmp_path / "eng")


def test_inspect_given_a_graph_file_says_to_give_the_engine_folder(tiny_engines, capsys):
    assert cli.main(["inspect", str(tiny_engines / "target" / "decode.onnx")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a file" in err and "engine folder" in err


# --------------------------------------------------------------------------- CLI: one line, exit 2, checked first


def _one_error_line(capsys, *words) -> str:
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("specrt: error:") and "Traceback" not in err, err
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


def _no_bench(monkeypatch):
    import specrt.tools.bench

    def boom(*a, **k):
        raise AssertionError("bench ran before its arguments were checked")
    monkeypatch.setattr(specrt.tools.bench, "run_bench", boom)


@pytest.mark.parametrize("extra, words", [
    (["--json", "/nonexistent/dir/r.json"], ["does not exist"]),
    (["--hf-reference", "/nonexistent.gguf"], ["--hf-reference", "does not exist"]),
])
def test_bench_checks_its_output_and_reference_paths_before_running(tiny_engines, capsys, monkeypatch, extra, words):
    _no_bench(monkeypatch)
    assert cli.main(["bench", str(tiny_engines), *extra]) == 2
    _one_error_line(capsys, *words)


@pytest.mark.parametrize("flag", ["--prompts", "--rounds", "--threads", "--max-new-tokens"])
def test_bench_and_generate_refuse_counts_below_one(tiny_engines, capsys, monkeypatch, flag):
    _no_bench(monkeypatch)
    for cmd in (["bench", str(tiny_engines)], ["generate", str(tiny_engines), "hi"]):
        if flag in ("--prompts", "--rounds") and cmd[0] == "generate":
            continue
        with pytest.raises(SystemExit) as e:
            cli.main([*cmd, flag, "0"])
        assert e.value.code == 2
        _one_error_line(capsys, flag, ">= 1")


def test_cli_generate_with_a_non_utf8_prompt_is_one_error_line(tiny_engines, capsys):
    bad = b"caf\xff".decode("utf-8", "surrogateescape")
    assert cli.main(["generate", str(tiny_engines), bad, "--max-new-tokens", "2"]) == 2
    _one_error_line(capsys, "PromptError", "UTF-8")


def test_cli_generate_on_engines_without_a_draft_decodes_plainly_and_the_api_names_plain_and_draft(
        tiny_pair, tmp_path, capsys):
    d = build_tiny(tmp_path / "plain", tiny_pair[0], "none")
    capsys.readouterr()                   # the build's own progress output
    # no --plain needed: the CLI runs what the folder has (the draft when there is one)
    assert cli.main(["generate", str(d), "hi", "--max-new-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert "tokens in" in err and "acceptance" not in err      # the summary of a plain generation
    assert cli.main(["generate", str(d), "hi", "--max-new-tokens", "2", "--plain"]) == 0
    gen = SpeculativeGenerator(d)
    msg = expect(SamplingParamsError, gen.tokens, prompt_of(3), method="speculative")
    assert "method='plain'" in msg and "--draft" in msg


# `specrt generate` whose stream stops after its first piece of text until a line arrives on stdin:
# the whole answer would fit in the pipe's buffer, so without the hold a child that ran ahead of the
# test would finish before the pipe closed and never meet it
_HELD_CLI = """
import sys
from specrt import cli
from specrt.runtime import SpeculativeGenerator
stream = SpeculativeGenerator.stream

def held(self, *a, **kw):
    pieces = stream(self, *a, **kw)
    for chunk in pieces:
        yield chunk
        if chunk.text:
            break
    sys.stdin.readline()
    yield from pieces

SpeculativeGenerator.stream = held
sys.exit(cli.main(sys.argv[1:]))
"""


def test_cli_generate_into_a_closed_pipe_exits_quietly(tiny_engines):
    p = subprocess.Popen([sys.executable, "-c", _HELD_CLI, "generate", str(tiny_engines), "tell me a long story",
                          "--max-new-tokens", "80", "--raw"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.read(1)
    p.stdout.close()                      # like `| head -c 1`
    p.stdin.write(b"go on\n")             # the rest of the answer goes into the closed pipe
    p.stdin.close()
    err = p.stderr.read().decode()
    assert p.wait(120) == 1, err          # it met the closed pipe (main's BrokenPipeError)
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_preset_model_is_found_from_another_folder_or_named_with_what_to_do(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    from specrt.builder.config import preset_model
    from specrt.errors import SpecrtError
    with pytest.raises(SpecrtError) as e:
        preset_model(".cache/models/none/missing.gguf")
    assert "make model" in str(e.value) and "--target" in str(e.value)
    checkout_file = "specrt/__init__.py"    # any file of the checkout, relative to it
    assert Path(preset_model(checkout_file)).is_file()
    assert os.getcwd() == str(tmp_path)


# --------------------------------------------------------------------------- errors keep their cause


def test_onnxruntime_rejecting_an_intact_graph_is_a_backend_error_with_its_cause(tiny_engines, monkeypatch):
    import onnxruntime as ort

    from specrt.errors import BackendError

    def reject(*a, **k):
        raise RuntimeError("Failed to allocate memory for requested buffer of size 123")
    monkeypatch.setattr(ort, "InferenceSession", reject)
    msg = expect(BackendError, SpeculativeGenerator, tiny_engines)
    assert "allocate memory" in msg and "intact" in msg and "corrupt" not in msg
    with pytest.raises(BackendError) as e:
        SpeculativeGenerator(tiny_engines)
    assert isinstance(e.value.__cause__, RuntimeError)      # kept for the operator's traceback


def test_a_damaged_graph_is_named_damaged_even_when_onnxruntime_fails_first(tiny_engines, tmp_path):
    d = copy_engines(tiny_engines, tmp_path)
    data = bytearray((d / "target" / "prefill.onnx").read_bytes())
    data[len(data) // 3: len(data) // 3 + 64] = b"\x07" * 64
    (d / "target" / "prefill.onnx").write_bytes(bytes(data))
    assert "prefill.onnx" in expect(GraphFileError, SpeculativeGenerator, d)


def test_when_another_component_owns_the_global_pool_sessions_fall_back_and_still_generate(tiny_engines):
    code = f"""
import logging, onnxruntime as ort
logging.basicConfig(level=logging.WARNING)
def taken(*a, **k):
    raise RuntimeError("Global thread pools have already been created")
ort.set_global_thread_pool_sizes = taken
from specrt.runtime import SpeculativeGenerator
from specrt.runtime.backends import ort_cpu
g = SpeculativeGenerator({str(tiny_engines)!r})
assert ort_cpu._THREADS_CONFIGURED == -1
print("tokens", len(g.generate([5, 6, 7], max_new_tokens=5).tokens))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "tokens 5" in r.stdout and "own pools" in r.stderr


def test_the_build_uses_its_thread_setting_and_refuses_one_the_process_pool_cannot_honour(tiny_pair, tmp_path):
    from specrt.builder.config import BuildConfig
    from specrt.builder.pipeline import build
    from specrt.runtime.backends.ort_cpu import pool_threads
    configure_threads(2)
    cfg = BuildConfig(target=str(tiny_pair[0]), out=str(tmp_path / "e"), draft="none", max_context=96,
                      prefill_chunk=16, k=3, threads=3)
    assert "threads=2" in expect(ConfigError, build, cfg, progress=False)
    assert not (tmp_path / "e").exists() and pool_threads() == 2
    code = ("import sys; sys.path.insert(0, 'tests');"
            "from specrt.builder.config import BuildConfig; from specrt.builder.pipeline import build;"
            "from specrt.runtime.backends.ort_cpu import pool_threads;"
            f"build(BuildConfig(target={str(tiny_pair[0])!r}, out={str(tmp_path / 'f')!r}, draft='int8',"
            " max_context=96, prefill_chunk=16, k=3, threads=1), progress=False); print('pool', pool_threads())")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                       cwd=Path(__file__).parents[1])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "pool 1" in r.stdout
