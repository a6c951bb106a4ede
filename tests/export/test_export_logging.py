"""An export quiets the exporter's logger only while it runs: the process's logging is as
it was afterwards, whether the export succeeded or failed."""
from __future__ import annotations

import logging

import pytest
from tiny_models import make_tiny_model_dir

from specrt.errors import ExportError
from specrt.export import onnx_export, sources
from specrt.manifest import Shapes

SHAPES = Shapes(batch=1, max_context=32, prefill_chunk=8, k=2)
SENTINEL = 7   # a level nobody sets, so "restored" cannot be confused with a default


@pytest.fixture
def exporter_logger():
    logger = logging.getLogger(onnx_export.EXPORTER_LOGGER)
    old = logger.level
    logger.setLevel(SENTINEL)
    yield logger
    logger.setLevel(old)


def test_an_export_leaves_every_logger_level_as_it_found_it(tmp_path, exporter_logger):
    lm = sources.load_source(make_tiny_model_dir(tmp_path / "m", "llama", layers=1))
    manager = logging.Logger.manager
    before = {name: lg.level for name, lg in manager.loggerDict.items() if isinstance(lg, logging.Logger)}
    root = logging.getLogger().level
    onnx_export.export_model(lm, SHAPES, tmp_path / "onnx", graphs=("decode",))
    assert (tmp_path / "onnx" / "decode.onnx").is_file()
    assert exporter_logger.level == SENTINEL
    assert logging.getLogger().level == root
    changed = {name: (level, manager.loggerDict[name].level) for name, level in before.items()
               if manager.loggerDict[name].level != level}
    assert not changed, changed


def test_a_failed_export_restores_the_level_too(tmp_path, exporter_logger, monkeypatch):
    seen = []

    def failing_export(*args, **kwargs):
        seen.append(logging.getLogger(onnx_export.EXPORTER_LOGGER).level)
        raise RuntimeError("boom")

    monkeypatch.setattr(onnx_export.torch.onnx, "export", failing_export)
    lm = sources.load_source(make_tiny_model_dir(tmp_path / "m", "llama", layers=1))
    with pytest.raises(ExportError, match="boom"):
        onnx_export.export_model(lm, SHAPES, tmp_path / "onnx", graphs=("decode",))
    assert seen == [logging.ERROR]              # quiet while the exporter ran
    assert exporter_logger.level == SENTINEL    # and back afterwards
