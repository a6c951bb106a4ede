"""`specrt triton-repo`: the repository layout, and model.py's logic driven without a
Triton server (a stand-in `triton_python_backend_utils` is injected). The live server
run is `tests/serve/triton_e2e.py` (needs nvidia-pytriton's tritonserver; see README)."""
from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys

import numpy as np
import pytest

from specrt.serve.triton import TritonRepoError, write_triton_repo

from . import fake_triton

FINAL = 1


def params(config: str) -> dict:
    return dict(re.findall(r'key: "(\w+)" value: \{ string_value: ("(?:[^"\\]|\\.)*") \}', config))


@pytest.fixture
def model(tiny_self_engines, tmp_path, monkeypatch):
    """The TritonPythonModel of a freshly written repository, initialized as Triton would."""
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake_triton.module())
    model_dir = write_triton_repo(tiny_self_engines, tmp_path / "repo", model_name="tiny")
    spec = importlib.util.spec_from_file_location("triton_model_under_test", model_dir / "1" / "model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    config = (model_dir / "config.pbtxt").read_text()
    m = mod.TritonPythonModel()
    m.initialize({"model_config": json.dumps({"parameters": {k: {"string_value": json.loads(v)}
                                                             for k, v in params(config).items()}}),
                  "model_repository": str(model_dir), "model_instance_kind": "CPU"})
    return m


def run(model, **inputs) -> fake_triton.Request:
    req = fake_triton.Request(**inputs)
    assert model.execute([req]) is None     # decoupled: nothing is returned, all is sent
    return req


def text_of(req) -> str:
    return "".join(r.output("text_output") for r, _ in req.sender.sent)


def test_the_repository_is_a_decoupled_python_backend_model(tiny_self_engines, tmp_path):
    out = tmp_path / "repo"
    r = subprocess.run([sys.executable, "-m", "specrt.cli", "triton-repo", str(tiny_self_engines), str(out),
                        "--model-name", "tiny", "--instances", "2"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*")) == \
        ["tiny", "tiny/.specrt-triton", "tiny/1", "tiny/1/model.py", "tiny/config.pbtxt"]
    config = (out / "tiny" / "config.pbtxt").read_text()
    assert 'name: "tiny"' in config and 'backend: "python"' in config
    assert re.search(r"model_transaction_policy \{ decoupled: true \}", config)
    assert re.search(r"instance_group \[ \{ count: 2 kind: KIND_CPU \} \]", config)
    for name in ("text_input", "max_tokens", "temperature", "top_p", "seed", "stop", "chat", "text_output",
                 "finish_reason"):
        assert f'name: "{name}"' in config
    assert json.loads(params(config)["engines"]) == str(tiny_self_engines.resolve())
    assert "class TritonPythonModel" in (out / "tiny" / "1" / "model.py").read_text()


def test_copy_engines_puts_them_in_the_model_folder(tiny_self_engines, tmp_path):
    model_dir = write_triton_repo(tiny_self_engines, tmp_path, model_name="m", copy_engines=True)
    assert (model_dir / "engines" / "manifest.json").is_file()
    assert json.loads(params((model_dir / "config.pbtxt").read_text())["engines"]) == "engines"


def test_the_repository_refuses_what_it_cannot_write(tiny_self_engines, tmp_path):
    (tmp_path / "taken").mkdir()
    with pytest.raises(TritonRepoError, match="not written by `specrt triton-repo`"):
        write_triton_repo(tiny_self_engines, tmp_path, model_name="taken")
    with pytest.raises(TritonRepoError, match="--model-name"):
        write_triton_repo(tiny_self_engines, tmp_path, model_name="a b")
    with pytest.raises(TritonRepoError, match="--instances"):
        write_triton_repo(tiny_self_engines, tmp_path, model_name="ok", instances=0)


def test_the_model_streams_the_runtime_greedy_output(model, reference):
    req = run(model, text_input=np.array([b"Once upon a time"], dtype=object), max_tokens=np.array([25], np.int32))
    want = reference.generate("Once upon a time", max_new_tokens=25)
    assert text_of(req) == want.text
    flags = [f for _, f in req.sender.sent]
    assert flags[-1] == FINAL and FINAL not in flags[:-1] and len(flags) > 2
    assert req.sender.sent[-1][0].output("finish_reason") == {"eos": "stop"}.get(want.finish_reason,
                                                                                want.finish_reason)


def test_the_model_takes_chat_stop_and_sampling_inputs(model, reference):
    from specrt.runtime import SamplingParams
    req = run(model, text_input=np.array([b"Hi"], dtype=object), max_tokens=np.array([30], np.int32),
              chat=np.array([True]), temperature=np.array([0.8], np.float32), top_p=np.array([0.9], np.float32),
              seed=np.array([5], np.int64))
    want = reference.generate("Hi", chat=True, max_new_tokens=30,
                              sampling=SamplingParams(temperature=float(np.float32(0.8)),
                                                      top_p=float(np.float32(0.9)), seed=5))
    assert text_of(req) == want.text
    full = reference.generate("Tell me", max_new_tokens=30).text
    req = run(model, text_input=np.array([b"Tell me"], dtype=object), max_tokens=np.array([30], np.int32),
              stop=np.array([full[5:7].encode()], dtype=object))
    assert text_of(req) == reference.generate("Tell me", max_new_tokens=30, stop=[full[5:7]]).text
    assert req.sender.sent[-1][0].output("finish_reason") == "stop"


def test_a_bad_request_gets_one_final_error_response(model):
    for inputs in ({"temperature": np.array([-1.0], np.float32)}, {"max_tokens": np.array([0], np.int32)},
                   {"text_input": np.array([b"x" * 500], dtype=object)}):
        req = run(model, **({"text_input": np.array([b"Hi"], dtype=object)} | inputs))
        [(resp, flags)] = req.sender.sent
        assert flags == FINAL and resp.error is not None and "Error" in resp.error.message()


def test_a_cancelled_request_stops_and_the_next_one_starts_clean(model, reference):
    req = fake_triton.Request(cancel_after=2, text_input=np.array([b"Once upon a time"], dtype=object),
                              max_tokens=np.array([40], np.int32))
    model.execute([req])
    resp, flags = req.sender.sent[-1]
    assert flags == FINAL and resp.error.code() == fake_triton.TritonError.CANCELLED
    assert len(req.sender.sent) <= 3
    req = run(model, text_input=np.array([b"abc"], dtype=object), max_tokens=np.array([20], np.int32))
    assert text_of(req) == reference.generate("abc", max_new_tokens=20).text


def _someone_elses_model(repo):
    """The issue's reproducer: a Triton model folder specrt did not write."""
    (repo / "eng" / "1").mkdir(parents=True)
    (repo / "eng" / "engines").mkdir()
    (repo / "eng" / "config.pbtxt").write_text("mine")
    (repo / "eng" / "1" / "model.py").write_text("mine")
    (repo / "eng" / "engines" / "precious.bin").write_text("data")


def test_a_model_folder_it_did_not_write_is_refused_and_left_intact(tiny_self_engines, tmp_path):
    repo = tmp_path / "repo"
    _someone_elses_model(repo)
    r = subprocess.run([sys.executable, "-m", "specrt.cli", "triton-repo", str(tiny_self_engines), str(repo),
                        "--model-name", "eng", "--copy-engines"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "TritonRepoError" in r.stderr and "--force" in r.stderr, r.stderr
    assert "precious.bin" in r.stderr and "Traceback" not in r.stderr
    assert (repo / "eng" / "config.pbtxt").read_text() == "mine"
    assert (repo / "eng" / "1" / "model.py").read_text() == "mine"
    assert (repo / "eng" / "engines" / "precious.bin").read_text() == "data"


def test_force_overwrites_it_and_a_rewrite_of_its_own_folder_needs_no_force(tiny_self_engines, tmp_path):
    repo = tmp_path / "repo"
    _someone_elses_model(repo)
    model = write_triton_repo(tiny_self_engines, repo, model_name="eng", copy_engines=True, force=True)
    assert not (model / "engines" / "precious.bin").exists() and (model / "engines" / "manifest.json").is_file()
    assert "class TritonPythonModel" in (model / "1" / "model.py").read_text()
    assert write_triton_repo(tiny_self_engines, repo, model_name="eng") == model    # its own: no force needed


def test_an_out_that_is_a_file_is_a_typed_error(tiny_self_engines, tmp_path):
    (tmp_path / "afile.txt").write_text("x")
    for out in (tmp_path / "afile.txt", tmp_path / "afile.txt" / "sub"):
        r = subprocess.run([sys.executable, "-m", "specrt.cli", "triton-repo", str(tiny_self_engines), str(out)],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "TritonRepoError" in r.stderr and "is a file" in r.stderr, r.stderr
    assert (tmp_path / "afile.txt").read_text() == "x"
