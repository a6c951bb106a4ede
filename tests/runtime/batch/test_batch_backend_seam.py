"""The batched engine opens its models through the backend registry (runtime/backends/base.py
`Backend.open_batch`), as the one-row runtime opens its graphs (`open_model`): the target's
step graph, the int8 self-draft's graph over its cache, a draft model with its own. A backend
without a batched runner is refused when the batch opens, naming what to do instead."""
from __future__ import annotations

import dataclasses

import pytest

from specrt.errors import ConfigError
from specrt.runtime.backends import base
from specrt.runtime.batch.generator import open_batch


def _swap(monkeypatch, **changes):
    key = ("onnxruntime", "cpu")
    real = base._REGISTRY[key]
    monkeypatch.setitem(base._REGISTRY, key, dataclasses.replace(real, **changes))
    return real


@pytest.mark.parametrize("folder, draft", [("tiny_batch_rows_draft_engines", ("batch", "draft", True)),
                                           ("tiny_batch_rows_model_engines", ("batch_draft", "step", False))])
def test_every_batched_model_comes_from_the_backends_open_batch(folder, draft, request, monkeypatch):
    engines = request.getfixturevalue(folder)
    opened = []
    real = base._REGISTRY[("onnxruntime", "cpu")]

    def recording(root, entry, shapes, **kw):
        opened.append((entry.role, kw.get("serves", "step"), kw.get("cache") is not None))
        return real.open_batch(root, entry, shapes, **kw)
    _swap(monkeypatch, open_batch=recording)
    with open_batch(engines, max_num_seqs=2) as g:
        assert g.generate("a b a b", max_new_tokens=4).tokens
    assert opened == [("batch", "step", False), draft]


def test_a_backend_without_a_batched_runner_is_refused_with_the_fix(tiny_batch_rows_draft_engines, monkeypatch):
    _swap(monkeypatch, open_batch=None)
    with pytest.raises(ConfigError, match="no batched runner.*--workers"):
        open_batch(tiny_batch_rows_draft_engines, max_num_seqs=2)
