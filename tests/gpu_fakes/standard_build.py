"""Build tiny engines with attention="standard" through the real build (`build_tiny`): the
standard graphs write the cache in place, as steps.kv records for them."""
from __future__ import annotations

from pathlib import Path


def build_standard(out: Path, target: Path, draft: str, **kw) -> Path:
    from conftest import build_tiny
    return build_tiny(out, target, draft, attention="standard", **kw)
