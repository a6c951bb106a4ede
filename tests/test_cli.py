"""The command line's habits: --version, defaults in --help, errors in flag words, numbers
rounded, and --quiet builds without the libraries' progress bars."""
from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys

import pytest

from specrt import __version__
from specrt import manifest as mf
from specrt.cli import main, make_parser
from specrt.cli_text import HelpFormatter, in_flag_words
from specrt.tools.describe import describe


def _cli(argv, capsys) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"specrt {__version__}"


def test_every_option_with_a_default_shows_it_in_help():
    commands = make_parser().commands.choices
    assert {"build", "generate", "bench", "profile", "inspect", "quality", "serve", "triton-repo",
            "qdq"} <= set(commands)
    for name, parser in commands.items():
        formatter = HelpFormatter(prog=parser.prog)
        for action in parser._actions:
            if not action.option_strings or isinstance(action, argparse._HelpAction):
                continue
            d = action.default
            if d is None or d is False or d in ([], ""):
                continue
            assert "default" in formatter._get_help_string(action), (name, action.option_strings)


def test_help_shows_defaults_on_generate_build_and_serve():
    commands = make_parser().commands.choices
    generate = commands["generate"].format_help()
    assert "(default: 128)" in generate and "(default: 0.0)" in generate and "--min-p" in generate
    build = " ".join(commands["build"].format_help().split())
    assert "(default: 1024)" in build and "(default: 64)" in build     # --max-context, --prefill-chunk
    assert "(default: None)" not in build
    serve = commands["serve"].format_help()
    assert "--served-model-name" in serve and "(default: 8000)" in serve


def test_served_model_name_is_an_alias_of_model_name():
    serve = make_parser()
    a = serve.parse_args(["serve", "eng", "--served-model-name", "m1"])
    b = serve.parse_args(["serve", "eng", "--model-name", "m1"])
    assert a.model_name == b.model_name == "m1"


def test_a_lookup_error_names_the_flags_not_the_python_arguments(tiny_self_engines, capsys):
    rc, _, err = _cli(["generate", tiny_self_engines, "hi", "--raw", "--lookup", "2", "--temperature", "0.5"],
                      capsys)
    assert rc == 2 and err.startswith("specrt: error: SamplingParamsError:")
    assert "--lookup (prompt lookup) is greedy only: use --temperature 0" in err
    assert "method=" not in err and "temperature=" not in err


def test_flag_words_cover_the_method_arguments_and_leave_other_names():
    generate = make_parser().commands.choices["generate"]
    msg = ("these engines were built without a draft model (--draft none): pass methods=('plain',) or "
           "('plain', 'lookup') (`specrt generate --plain`, or --lookup 2 for prompt lookup), or rebuild")
    assert in_flag_words(msg, generate) == ("these engines were built without a draft model (--draft none): pass "
                                            "--plain (or --lookup 2 for prompt lookup), or rebuild")
    assert in_flag_words("memory='shared' is slow; top_p=1.5 and max_context=96", generate) == \
        "--memory shared is slow; --top-p 1.5 and max_context=96"      # max_context is no flag of generate


def test_inspect_prints_measured_numbers_rounded(tiny_self_engines):
    man = mf.load(tiny_self_engines)
    plan = {"costs_ms": {"target_decode": 6.312345678, "target_verify": 9.87654321},
            "acceptance": 0.9945652173913043, "predicted": {"k=4": 1.951234}, "chosen": {"method": "speculative",
                                                                                      "k": 4}}
    text = describe(dataclasses.replace(man, build={**man.build, "speculation": plan}))
    line = next(x for x in text.splitlines() if x.startswith("plan"))
    assert "acceptance 0.9946" in line and "decode 6.312," in line and "verify 9.877," in line
    assert "0.9945652173913043" not in text


BARS = ("Loading weights", "it/s]", "%|")


def _build(tiny_pair, out, *extra) -> subprocess.CompletedProcess:
    target, _ = tiny_pair
    return subprocess.run([sys.executable, "-m", "specrt.cli", "build", "--target", str(target), "--out", str(out),
                           "--draft", "none", "--no-measure-costs", "--ngram-tokens", "0", "--max-context", "32",
                           "--prefill-chunk", "8", "--k", "2", *extra], capture_output=True, text=True, timeout=600)


def test_quiet_build_hides_the_libraries_progress_bars(tiny_pair, tmp_path):
    loud = _build(tiny_pair, tmp_path / "loud")
    assert loud.returncode == 0, loud.stderr
    assert any(bar in loud.stderr for bar in BARS), loud.stderr      # else this test would prove nothing
    quiet = _build(tiny_pair, tmp_path / "quiet", "--quiet")
    assert quiet.returncode == 0, quiet.stderr
    assert not any(bar in quiet.stderr for bar in BARS), quiet.stderr
    assert "built" in quiet.stdout


def test_build_passes_batch_prefill_to_the_config_and_refuses_it_without_batch(capsys, tmp_path, monkeypatch):
    import specrt.builder.pipeline as pipeline
    seen = {}

    def fake_build(cfg, progress=True, force=False):      # the CLI's plumbing only: no export
        seen["cfg"] = cfg
        return tmp_path / "out"
    monkeypatch.setattr(pipeline, "build", fake_build)
    rc, _, err = _cli(["build", "--target", tmp_path / "m", "--out", tmp_path / "o", "--batch-prefill", "rowwise"],
                      capsys)
    assert rc == 2 and "add --batch" in err and "cfg" not in seen
    rc, _, _ = _cli(["build", "--target", tmp_path / "m", "--out", tmp_path / "o", "--batch", "--batch-prefill",
                     "rowwise"], capsys)
    assert rc == 0 and seen["cfg"].batch and seen["cfg"].batch_prefill == "rowwise"
    rc, _, _ = _cli(["build", "--target", tmp_path / "m", "--out", tmp_path / "o", "--batch"], capsys)
    assert seen["cfg"].batch_prefill == "auto" and seen["cfg"].batch_prefill_graph == "same"     # fp32
    rc, _, _ = _cli(["build", "--target", tmp_path / "m", "--out", tmp_path / "o", "--batch", "--precision", "int4"],
                    capsys)
    assert rc == 0 and seen["cfg"].batch_prefill_graph == "rowwise-gqa"
    rc, _, _ = _cli(["build", "--target", tmp_path / "m", "--out", tmp_path / "o", "--batch", "--precision", "int4",
                     "--batch-prefill", "rowwise-gqa"], capsys)
    assert rc == 0 and seen["cfg"].batch_prefill == "rowwise-gqa"
    rc, _, _ = _cli(["build", "--target", tmp_path / "m", "--out", tmp_path / "o", "--batch", "--precision", "int4",
                     "--batch-prefill", "same"], capsys)
    assert rc == 0 and seen["cfg"].batch_prefill_graph == "same"


def test_build_passes_batch_attention_to_the_config(capsys, tmp_path, monkeypatch):
    import specrt.builder.pipeline as pipeline
    seen = {}

    def fake_build(cfg, progress=True, force=False):      # the CLI's plumbing only: no export
        seen["cfg"] = cfg
        return tmp_path / "out"
    monkeypatch.setattr(pipeline, "build", fake_build)
    rc, _, err = _cli(["build", "--target", tmp_path / "m", "--out", tmp_path / "o", "--batch-attention", "rows"],
                      capsys)
    assert rc == 2 and "add --batch" in err and "cfg" not in seen
    rc, _, _ = _cli(["build", "--target", tmp_path / "m", "--out", tmp_path / "o", "--batch", "--batch-attention",
                     "rows"], capsys)
    assert rc == 0 and seen["cfg"].batch_attention == "rows"
