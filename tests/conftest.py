"""Shared fixtures: tiny random models exported once per session, and the real default
engines (built by `make engines`; tests that need them fail with that instruction).

With SPECRT_TINY_CACHE=<dir> set (`make mutation` sets it), the tiny models and engines
are built once into that folder, keyed by a hash of the build sources, and reused by
later pytest sessions: a mutant run then spends its time in the tests, not the builds."""
from __future__ import annotations

import hashlib
import inspect
import os
import sys
from pathlib import Path

import pytest
from filelock import FileLock

# engines price their rounds with the build's cost table alone, not corrected by the loop's own
# timings (runtime/batch/live_costs.py): choices that depend on this machine's load
# would make the tests that count them flaky; tests/runtime/batch/test_live_costs.py turns it on
os.environ["SPECRT_LIVE_COSTS"] = "0"

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))
ROOT = TESTS.parent
REAL_ENGINES = Path(os.environ.get("SPECRT_ENGINES", ROOT / "artifacts" / "smollm2"))
TINY_CACHE = os.environ.get("SPECRT_TINY_CACHE")
# the draft kinds a build knows: "model" is a draft model path (here the target itself, so
# greedy acceptance is exactly 1), the others are BuildConfig.draft values
DRAFT_KINDS = ("model", "truncate:2", "int8", "none")
ATTENTIONS = ("gqa", "portable")   # K/V written in place by the graph / returned and copied by KVCache.write
MATRIX_CONTEXT = 160               # room for 128 generated tokens after a short prompt


def _build_key() -> str:
    """Hash of everything a tiny build depends on (not the runtime: mutating it keeps the cache)."""
    h = hashlib.sha256()
    src = ROOT / "specrt"
    globs = [sorted(src.glob(g)) for g in ("export/*.py", "calibration/*.py", "engines/*.py", "builder/**/*.py",
                                           "heads/*.py")]
    assert all(globs), "a build-side folder moved: update _build_key (a stale key reuses outdated tiny engines)"
    files = [*sum(globs, []), src / "driver.py", src / "manifest.py", src / "cpu_features.py", TESTS / "tiny_models.py"]
    for f in sorted(files):
        h.update(str(f.relative_to(ROOT)).encode() + f.read_bytes())
    h.update(inspect.getsource(build_tiny).encode())
    return h.hexdigest()[:16]


def _once(tmp_path_factory, name: str, make) -> Path:
    """make(dir) -> path, run once and reused: into a fresh temporary folder in a plain run;
    under pytest-xdist (`make test` runs two workers) into the temporary folder all workers
    share, behind a file lock, so the first worker builds and the other waits and reuses it
    (pytest-xdist's documented pattern for session fixtures); with SPECRT_TINY_CACHE, into that
    folder keyed by the build sources, reused by later sessions too."""
    name = name.replace(":", "")
    if TINY_CACHE:
        root = Path(TINY_CACHE) / _build_key()
    elif os.environ.get("PYTEST_XDIST_WORKER"):
        root = tmp_path_factory.getbasetemp().parent / "shared"     # one basetemp per worker
    else:
        return Path(make(tmp_path_factory.mktemp(name)))
    done = root / name
    done.mkdir(parents=True, exist_ok=True)
    with FileLock(str(done) + ".lock"):
        if not (done / "ok").exists():      # absent after a build that failed half-way: build again
            (done / "path").write_text(str(make(done)))
            (done / "ok").touch()
    return Path((done / "path").read_text())


@pytest.fixture(scope="session")
def real_engines() -> Path:
    if not (REAL_ENGINES / "manifest.json").exists():
        pytest.fail(f"no engines at {REAL_ENGINES}: run `make engines` first (the README's `make test` does)")
    return REAL_ENGINES


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    from tiny_models import make_pair
    root = _once(tmp_path_factory, "pair",
                 lambda d: make_pair(d, target_layers=3, draft_layers=1, vocab_size=128)[0].parent)
    return root / "target", root / "draft"


def build_tiny(out: Path, target: Path, draft: str, **kw) -> Path:
    from specrt.builder.config import BuildConfig
    from specrt.builder.pipeline import build
    # measure_costs off: these engines test the fixed-k loop; adaptive k has its own tests
    cfg = BuildConfig(target=str(target), out=str(out), draft=draft, max_context=kw.pop("max_context", 96),
                      prefill_chunk=kw.pop("prefill_chunk", 16), k=kw.pop("k", 3),
                      measure_costs=kw.pop("measure_costs", False), ngram_tokens=kw.pop("ngram_tokens", 512), **kw)
    return build(cfg, progress=False)


@pytest.fixture(scope="session")
def tiny_engines(tmp_path_factory, tiny_pair) -> Path:
    """A tiny llama target (3 layers) with a separate 1-layer draft, own caches."""
    target, draft = tiny_pair
    return _once(tmp_path_factory, "eng-pair", lambda d: build_tiny(d / "pair", target, str(draft)))


@pytest.fixture(scope="session")
def tiny_int4_engines(tmp_path_factory, tiny_pair) -> Path:
    """The tiny target quantized to int4 (MatMulNBits, int8 compute: a two-row decode graph)
    with its dynamic-INT8 copy as draft."""
    target, _ = tiny_pair
    return _once(tmp_path_factory, "eng-int4",
                 lambda d: build_tiny(d / "int4", target, "int8", precision="int4", block_size=16))


@pytest.fixture(scope="session")
def tiny_batch_engines(tmp_path_factory, tiny_pair) -> Path:
    """The tiny target quantized to int4 with its batched copy, as `specrt build --precision
    int4 --batch --batch-attention gqa` makes it: the graph "step" with a symbolic row count
    (GroupQueryAttention, int4: plain one-token steps, every caller), and "prefill", the same
    graph with int8 per-channel weights for prompt chunks (`--batch-prefill auto`, rowwise-gqa for
    int4: rowwise, as the step graph already attends with GroupQueryAttention); no draft."""
    target, _ = tiny_pair
    return _once(tmp_path_factory, "eng-batch", lambda d: build_tiny(d / "batch", target, "none", precision="int4",
                                                                     block_size=16, batch=True, batch_attention="gqa",
                                                                     ngram_tokens=0))


@pytest.fixture(scope="session")
def tiny_batch_int4_engines(tmp_path_factory, tiny_pair) -> Path:
    """The tiny target as `specrt build --precision int4 --batch` makes it by default: the step
    graph in "rows" attention (int4), the prompt graph int8 per channel attending with
    GroupQueryAttention over the same cache (`--batch-prefill auto` is rowwise-gqa for int4), and
    the int8 self-draft's one-token graph ("draft", GroupQueryAttention) beside them."""
    target, _ = tiny_pair
    return _once(tmp_path_factory, "eng-batch-int4",
                 lambda d: build_tiny(d / "batch4", target, "int8", precision="int4", block_size=16, batch=True,
                                      measure_costs=True, ngram_tokens=0))


@pytest.fixture(scope="session")
def tiny_batch_int4_rowwise_engines(tmp_path_factory, tiny_pair) -> Path:
    """tiny_batch_int4_engines with `--batch-prefill rowwise`: the prompt graph attends as the
    step graph does ("rows"), everything else the same."""
    target, _ = tiny_pair
    return _once(tmp_path_factory, "eng-batch-int4-rowwise",
                 lambda d: build_tiny(d / "batch4r", target, "int8", precision="int4", block_size=16, batch=True,
                                      batch_prefill="rowwise", measure_costs=True, ngram_tokens=0))


@pytest.fixture(scope="session")
def tiny_batch_same_engines(tmp_path_factory, tiny_pair) -> Path:
    """tiny_batch_engines with `--batch-prefill same`: one batched graph (int4) for prompt chunks
    and decode steps alike, one weights copy; what device buckets run."""
    target, _ = tiny_pair
    return _once(tmp_path_factory, "eng-batch-same",
                 lambda d: build_tiny(d / "batch-same", target, "none", precision="int4", block_size=16, batch=True,
                                      batch_attention="gqa", batch_prefill="same", ngram_tokens=0))


@pytest.fixture(scope="session")
def tiny_batch_b64_engines(tmp_path_factory, tiny_pair) -> Path:
    """tiny_batch_engines with the batched graph quantized in blocks of 64 (`--batch-block-size
    64`): ONNX Runtime's int4 kernel then rounds a call's odd last row apart, so the manifest
    asks for an even number of rows per call (io row_multiple 2). Prompt chunks run through the
    same graph (`--batch-prefill same`), so the padding of multi-token calls is exercised too."""
    target, _ = tiny_pair
    return _once(tmp_path_factory, "eng-batch-b64",
                 lambda d: build_tiny(d / "b64", target, "none", precision="int4", block_size=16, batch=True,
                                      batch_attention="gqa", batch_block_size=64, batch_prefill="same",
                                      ngram_tokens=0))


@pytest.fixture(scope="session")
def tiny_batch_standard_engines(tmp_path_factory, tiny_pair) -> Path:
    """The tiny fp32 target with its batched copy in standard ONNX ops (`--attention standard
    --batch`): a position's logits do not depend on its window, so the batched engine
    speculates inside a batch; the build measures the batched step costs."""
    target, _ = tiny_pair
    return _once(tmp_path_factory, "eng-batch-standard",
                 lambda d: build_tiny(d / "batchs", target, "none", attention="standard", batch=True,
                                      measure_costs=True, ngram_tokens=0))


@pytest.fixture(scope="session")
def tiny_batch_rows_engines(tmp_path_factory, tiny_pair) -> Path:
    """The tiny fp32 target (gqa) with its batched copy in plain ops over the used part of the
    cache (`--batch --batch-attention rows`): a position's logits do not depend on its window
    from one token a row, so the batch speculates without padding its plain steps."""
    target, _ = tiny_pair
    return _once(tmp_path_factory, "eng-batch-rows",
                 lambda d: build_tiny(d / "batchr", target, "none", batch=True, batch_attention="rows",
                                      measure_costs=True, ngram_tokens=0))


@pytest.fixture(scope="session")
def tiny_head(tmp_path_factory, tiny_pair) -> tuple[Path, Path]:
    """(engines, head): the tiny fp32 target's batched model in rows attention returning the
    hidden states of layers 0 and 1 (`--batch --hidden-layers 0,1`) with the int8 self-draft
    beside it (as `--preset smollm2 --batch --hidden-layers ...` builds: its one-token graph
    returns no hidden states), and a draft head trained on its answers by `specrt
    train-draft`'s recipe (24 prompts x 24 tokens; seconds)."""
    target, _ = tiny_pair

    def make(d):
        from specrt.heads.recipe import Recipe, run
        eng = build_tiny(d / "eng", target, "int8", batch=True, batch_attention="rows", measure_costs=True,
                         ngram_tokens=0, hidden_layers=(0, 1))
        run(Recipe(engines=eng, out=d / "head", max_prompts=24, max_new_tokens=24, draft_vocab=64, steps=3,
                   epochs=8, lr=3e-3, seed=0, max_num_seqs=4), progress=False)
        return d
    root = _once(tmp_path_factory, "eng-head", make)
    return root / "eng", root / "head"


@pytest.fixture(scope="session")
def tiny_batch_rows_draft_engines(tmp_path_factory, tiny_pair) -> Path:
    """tiny_batch_rows_engines with the int8 self-draft (`--draft int8`): the batched model gets
    a "draft" graph, the int8 copy of its step graph, that runs inside the batch."""
    target, _ = tiny_pair
    return _once(tmp_path_factory, "eng-batch-rows-draft",
                 lambda d: build_tiny(d / "batchrd", target, "int8", batch=True, batch_attention="rows",
                                      measure_costs=True, ngram_tokens=0))


@pytest.fixture(scope="session")
def tiny_batch_rows_model_engines(tmp_path_factory, tiny_pair) -> Path:
    """tiny_batch_rows_engines with a separate draft model, the target's first 2 layers (`--draft
    truncate:2`; a draft from another folder takes the same path with layers=None): the build
    gives it a batch dimension too (models.batch_draft), and it runs inside the batch with its
    own cache."""
    target, _ = tiny_pair
    return _once(tmp_path_factory, "eng-batch-rows-trunc",
                 lambda d: build_tiny(d / "batchrm", target, "truncate:2", batch=True, batch_attention="rows",
                                      measure_costs=True, ngram_tokens=0))


@pytest.fixture(scope="session")
def tiny_self_engines(tmp_path_factory, tiny_pair) -> Path:
    """The tiny target with its dynamic-INT8 copy as draft (shared cache)."""
    target, _ = tiny_pair
    return _once(tmp_path_factory, "eng-self", lambda d: build_tiny(d / "self", target, "int8"))


@pytest.fixture(scope="session")
def tiny_truncated_engines(tmp_path_factory, tiny_pair) -> Path:
    """The tiny target with its own first 2 layers as draft: related but different
    distributions, so sampled drafts are both accepted and rejected."""
    target, _ = tiny_pair
    return _once(tmp_path_factory, "eng-trunc", lambda d: build_tiny(d / "trunc", target, "truncate:2"))


@pytest.fixture(scope="session")
def tiny_matrix(tmp_path_factory, tiny_pair):
    """engines(kind, attention) for every DRAFT_KINDS x ATTENTIONS, max_context=MATRIX_CONTEXT,
    each built on first use and kept for the session."""
    target, _ = tiny_pair
    built: dict[tuple[str, str], Path] = {}

    def engines(kind: str, attention: str) -> Path:
        if (kind, attention) not in built:
            draft = str(target) if kind == "model" else kind
            built[kind, attention] = _once(
                tmp_path_factory, f"matrix-{kind}-{attention}",
                lambda d: build_tiny(d / "eng", target, draft, attention=attention, max_context=MATRIX_CONTEXT))
        return built[kind, attention]

    return engines


def pytest_collection_modifyitems(items):
    """Any test that uses the real default engines is a `real_model` test (`-m "not real_model"`
    runs the suite without `make engines`)."""
    for item in items:
        if "real_engines" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.real_model)
