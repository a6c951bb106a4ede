"""Build tiny engines with attention="standard" through the real pipeline (`build_tiny`).

pipeline._kv marks only "gqa" graphs as writing the cache in place; the standard graphs'
present_* outputs alias the cache too. Until pipeline.py says so itself (one-line change
reported to the lead: `"in_place" if cfg.attention in graph.IN_PLACE`), the build runs
with _kv patched; once it does, the patch changes nothing."""
from __future__ import annotations

from pathlib import Path

import pytest


def build_standard(out: Path, target: Path, draft: str, **kw) -> Path:
    from conftest import build_tiny

    from specrt import pipeline
    from specrt.export.graph import IN_PLACE

    kv = pipeline._kv

    def kv_in_place(cfg, shares):
        return {**kv(cfg, shares), **({"update": "in_place"} if cfg.attention in IN_PLACE else {})}

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipeline, "_kv", kv_in_place)
        return build_tiny(out, target, draft, attention="standard", **kw)
