"""`specrt triton-repo`: the repository layout, and model.py's logic driven without a
Triton server (a stand-in `triton_python_backend_utils` is injected). The live server
run is `tests/serve/triton_e2e.py` (needs nvidia-pytriton's tritonserver; see README)."""
from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import threading

import numpy as np
import pytest

from specrt.runtime.batch.generator import open_batch
from specrt.serve.triton import TritonRepoError, write_triton_repo

from . import fake_triton
from .serve_helpers import WAIT_S, wait_for

FINAL = 1


def params(config: str) -> dict:
    return dict(re.findall(r'key: "(\w+)" value: \{ string_value: ("(?:[^"\\]|\\.)*") \}', config))


def load_model(engines, out, **repo):
    """The TritonPythonModel of a freshly written repository, initialized as Triton would
    (the stand-in `triton_python_backend_utils` must be in sys.modules)."""
    model_dir = write_triton_repo(engines, out, model_name="tiny", **repo)
    spec = importlib.util.spec_from_file_location("triton_model_under_test", model_dir / "1" / "model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    config = (model_dir / "config.pbtxt").read_text()
    m = mod.TritonPythonModel()
    m.initialize({"model_config": json.dumps({"parameters": {k: {"string_value": json.loads(v)}
                                                             for k, v in params(config).items()}}),
                  "model_repository": str(model_dir), "model_instance_kind": "CPU"})
    return m


@pytest.fixture
def model(tiny_self_engines, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake_triton.module())
    return load_model(tiny_self_engines, tmp_path / "repo")


def run(model, **inputs) -> fake_triton.Request:
    """One request, answered (its FINAL sent) from the engine thread."""
    req = fake_triton.Request(**inputs)
    assert model.execute([req]) is None     # decoupled: nothing is returned, all is sent
    req.sender.wait()
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
    resp, flags = req.sender.wait().sent[-1]
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


# --- the batched model (`--max-num-seqs`): one BatchGenerator, execute returns at once ------------

PROMPTS = ["hello there", "the quick brown fox", "x", "one two three four five six", "to be or not"]
NEW = 16
SAMPLED = {"chat": True, "max_new_tokens": 20}      # + temperature 0.8, top_p 0.9, seed 5


@pytest.fixture(scope="module")
def alone(tiny_batch_engines):
    """What each request gets served alone (greedy; the sampled chat request; a stop string)."""
    from specrt.runtime import SamplingParams
    ref = open_batch(tiny_batch_engines, max_num_seqs=1)
    try:
        out = {p: ref.generate(p, max_new_tokens=NEW).text for p in PROMPTS}
        out["sampled"] = ref.generate("Hi", sampling=SamplingParams(temperature=float(np.float32(0.8)),
                                                                    top_p=float(np.float32(0.9)), seed=5),
                                      **SAMPLED).text
        out["stop"] = (out["hello there"][4:6], ref.generate("hello there", max_new_tokens=NEW,
                                                             stop=[out["hello there"][4:6]]).text)
    finally:
        ref.close()
    return out


@pytest.fixture
def batched(tiny_batch_engines, tmp_path, monkeypatch):
    """batched(max_num_seqs=, queue_size=) -> a batched model; finalized at the end of the test."""
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", fake_triton.module())
    made = []

    def make(**repo):
        made.append(load_model(tiny_batch_engines, tmp_path / f"repo{len(made)}", **repo))
        return made[-1]
    yield make
    for m in made:
        m.finalize()


def greedy(prompt: str, **kw) -> fake_triton.Request:
    return fake_triton.Request(text_input=np.array([prompt.encode()], dtype=object),
                               max_tokens=np.array([NEW], np.int32), **kw)


def execute_returns(model, requests) -> None:
    """execute(requests) on Triton's thread: it must return while the answers are held back."""
    t = threading.Thread(target=model.execute, args=(requests,))
    t.start()
    t.join(WAIT_S)
    assert not t.is_alive(), "execute blocked until its requests were answered"


def answered(req) -> str:
    """The text of a request that ended with exactly one FINAL, its last response."""
    req.sender.wait()
    flags = [f for _, f in req.sender.sent]
    assert flags[-1] == FINAL and flags.count(FINAL) == 1, flags
    assert req.sender.sent[-1][0].error is None, req.sender.sent[-1][0].error.message()
    return text_of(req)


def error_of(req) -> tuple[str, int | None]:
    req.sender.wait()
    [(resp, flags)] = req.sender.sent[-1:]
    assert flags == FINAL and req.sender.finals == 1 and resp.error is not None, req.sender.sent
    return resp.error.message(), resp.error.code()


def test_triton_repo_max_num_seqs_writes_a_batched_decoupled_model(tiny_batch_engines, tmp_path):
    out = tmp_path / "repo"
    r = subprocess.run([sys.executable, "-m", "specrt.cli", "triton-repo", str(tiny_batch_engines), str(out),
                        "--model-name", "tiny", "--max-num-seqs", "4", "--queue-size", "2"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    config = (out / "tiny" / "config.pbtxt").read_text()
    assert re.search(r"model_transaction_policy \{ decoupled: true \}", config)
    assert re.search(r"instance_group \[ \{ count: 1 kind: KIND_CPU \} \]", config) and "count 1 is right" in config
    assert {k: json.loads(v) for k, v in params(config).items()} == {
        "engines": str(tiny_batch_engines.resolve()), "memory": "fast", "max_num_seqs": "4", "queue_size": "2"}
    plain = write_triton_repo(tiny_batch_engines, tmp_path / "plain", model_name="tiny")
    assert {k: json.loads(v) for k, v in params((plain / "config.pbtxt").read_text()).items()} == {
        "engines": str(tiny_batch_engines.resolve()), "memory": "fast", "max_num_seqs": "1", "queue_size": "8"}


def test_triton_repo_max_num_seqs_without_a_batch_model_is_refused(tiny_self_engines, tmp_path):
    r = subprocess.run([sys.executable, "-m", "specrt.cli", "triton-repo", str(tiny_self_engines),
                        str(tmp_path / "repo"), "--max-num-seqs", "4"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "TritonRepoError" in r.stderr and "specrt build ... --batch" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "repo").exists()


def test_requests_of_one_and_of_several_executes_run_together_and_each_equals_it_alone(batched, alone):
    from specrt.runtime.batch.generator import BatchGenerator
    model = batched(max_num_seqs=3)
    assert isinstance(model.batch, BatchGenerator)
    gate = threading.Event()        # every response waits: the engine thread is held on its first send
    first = [greedy(p, gate=gate) for p in PROMPTS[:3]]
    execute_returns(model, first)
    sampled = fake_triton.Request(gate=gate, text_input=np.array([b"Hi"], dtype=object), chat=np.array([True]),
                                  max_tokens=np.array([SAMPLED["max_new_tokens"]], np.int32),
                                  temperature=np.array([0.8], np.float32), top_p=np.array([0.9], np.float32),
                                  seed=np.array([5], np.int64))
    stop, want_stop = alone["stop"]
    stopped = greedy("hello there", gate=gate, stop=np.array([stop.encode()], dtype=object))
    second = [greedy(p, gate=gate) for p in PROMPTS[3:]] + [sampled, stopped]
    execute_returns(model, second)
    assert all(r.sender.finals == 0 for r in first + second)
    gate.set()
    assert [answered(r) for r in first + second[:2]] == [alone[p] for p in PROMPTS]
    assert answered(sampled) == alone["sampled"] and answered(stopped) == want_stop
    assert stopped.sender.sent[-1][0].output("finish_reason") == "stop"
    assert {t for r in first + second for t in r.sender.threads} == {"specrt-batch-engine"}
    assert model.batch.engine.stats.occupancy > 1          # rows shared steps


def test_a_cancelled_request_ends_with_one_final_and_the_others_answer(batched, alone):
    model = batched(max_num_seqs=3)
    cancelled = fake_triton.Request(cancel_after=2, text_input=np.array([b"Once upon a time"], dtype=object),
                                    max_tokens=np.array([40], np.int32))
    others = [greedy(p) for p in PROMPTS[:3]]
    model.execute([cancelled, *others])
    message, code = error_of(cancelled)
    assert code == fake_triton.TritonError.CANCELLED and len(cancelled.sender.sent) <= 3
    assert [answered(r) for r in others] == [alone[p] for p in PROMPTS[:3]]
    after = greedy(PROMPTS[3])      # answered after the engine's Done("cancelled") for the row
    model.execute([after])
    assert answered(after) == alone[PROMPTS[3]]
    assert cancelled.sender.finals == 1
    wait_for(lambda: model.batch.engine.idle(), "the rows to be freed")


def test_bad_requests_get_an_error_final_and_the_others_in_the_execute_answer(batched, alone):
    model = batched(max_num_seqs=2)
    gate = threading.Event()
    good = [greedy(p, gate=gate) for p in PROMPTS[:2]]
    bad = [greedy("Hi", temperature=np.array([-1.0], np.float32)),
           fake_triton.Request(text_input=np.array([b"Hi"], dtype=object), max_tokens=np.array([0], np.int32)),
           greedy("x " * 500)]
    execute_returns(model, [good[0], *bad, good[1]])
    for req in bad:     # answered by execute itself, before any engine step could send
        message, code = error_of(req)
        assert code == fake_triton.TritonError.INVALID_ARG and "Error" in message
    gate.set()
    assert [answered(r) for r in good] == [alone[p] for p in PROMPTS[:2]]


def test_a_full_queue_gets_an_unavailable_error_naming_max_num_seqs(batched, alone):
    model = batched(max_num_seqs=1, queue_size=1)
    gate = threading.Event()
    held = [greedy(p, gate=gate) for p in PROMPTS[:2]]      # the row and the one place in the queue
    execute_returns(model, held)
    eng = model.batch.engine
    wait_for(lambda: eng.active == 1 and eng.queued == 1, "one request in the row, one waiting")
    over = greedy(PROMPTS[2])
    execute_returns(model, [over])
    message, code = error_of(over)
    assert code == fake_triton.TritonError.UNAVAILABLE and "max_num_seqs 1" in message and "queue_size 1" in message
    gate.set()
    assert [answered(r) for r in held] == [alone[p] for p in PROMPTS[:2]]
    again = greedy(PROMPTS[2])      # places are given back as requests are answered
    model.execute([again])
    assert answered(again) == alone[PROMPTS[2]]


def test_a_sender_that_fails_drops_its_request_only(batched, alone):
    model = batched(max_num_seqs=3)
    broken = greedy(PROMPTS[0], fail_send=True)
    others = [greedy(p) for p in PROMPTS[1:4]]
    model.execute([broken, *others])
    assert [answered(r) for r in others] == [alone[p] for p in PROMPTS[1:4]]
    wait_for(lambda: model.batch.engine.idle(), "the broken request's row to be freed")
    assert model._open == 0


def test_finalize_ends_running_and_waiting_requests_with_one_final_each(batched):
    model = batched(max_num_seqs=1)
    gate = threading.Event()
    reqs = [greedy(p, gate=gate) for p in PROMPTS[:2]]      # one runs (held on its first send), one waits
    execute_returns(model, reqs)
    eng = model.batch.engine
    # the engine thread waits in the first one's send: it holds its row, none is on its way to one
    assert reqs[0].sender.held.wait(WAIT_S)
    wait_for(lambda: len(eng.waiting) == 1, "the second request to wait for the row")
    closing = threading.Thread(target=model.finalize)
    closing.start()
    wait_for(lambda: all(r.cancelled.is_set() for r in eng.waiting), "finalize to cancel the requests")
    gate.set()
    closing.join(WAIT_S)
    assert not closing.is_alive()
    for req in reqs:
        message, code = error_of(req)
        assert code == fake_triton.TritonError.CANCELLED and "unloaded" in message


def test_a_request_cancelled_while_it_waits_for_a_row_ends_before_it_gets_one(batched, alone):
    """One row, a long request on it; a second request waits, and its client cancels. The
    engine asks is_cancelled() at every step, so the waiting one ends with one FINAL CANCELLED
    without ever being prefilled (before, it was noticed only on its first token).

    The running request is held on its first send until both are submitted: on a busy machine
    the test's thread could otherwise be descheduled between the two submits while the engine
    answered all 40 tokens, and the second would get the free row (CI failed that way once)."""
    model = batched(max_num_seqs=1)
    eng = model.batch.engine
    chunks = eng.stats.prefill_chunks
    gate = threading.Event()
    running = fake_triton.Request(gate=gate, text_input=np.array([b"Once upon a time"], dtype=object),
                                  max_tokens=np.array([40], np.int32))
    waiting = greedy(PROMPTS[0], cancel_after=1)       # the engine's first poll passes, its second cancels
    execute_returns(model, [running, waiting])
    gate.set()                                          # both queued: the running one holds the only row
    message, code = error_of(waiting)
    assert code == fake_triton.TritonError.CANCELLED and "by the client" in message
    assert len(waiting.sender.sent) == 1               # no text: it never ran
    answered(running)
    assert eng.stats.prefill_chunks - chunks == 1      # the running request's prompt only
    wait_for(lambda: eng.idle(), "the engine to be idle")


def test_a_structured_request_gets_the_constrained_answer_and_bad_json_is_invalid(batched, tiny_batch_engines):
    """The optional `structured` input (JSON text, runtime/grammar.py) constrains the answer as
    the Python API does; text that is not JSON is an INVALID_ARG error, the others answer."""
    regex = r"(yes|no), [0-9]{1,3}\."
    ref = open_batch(tiny_batch_engines, max_num_seqs=1)
    try:
        want = ref.generate("hello there", max_new_tokens=NEW, structured={"regex": regex}).text
    finally:
        ref.close()
    model = batched(max_num_seqs=2)
    ok = greedy("hello there", structured=np.array([json.dumps({"regex": regex}).encode()], dtype=object))
    bad = greedy("hello there", structured=np.array([b"{regex"], dtype=object))
    model.execute([ok, bad])
    assert answered(ok) == want and re.fullmatch(regex, want)
    message, code = error_of(bad)
    assert code == fake_triton.TritonError.INVALID_ARG and "JSON" in message
