"""Helpers shared by the bad-input tests: every error must be exactly the typed error
expected, carry a message, and never be a raw traceback from a library underneath."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from specrt.errors import SpecrtError
from specrt.runtime import SpeculativeGenerator


def expect(exc_type: type[SpecrtError], fn, *args, **kw) -> str:
    """Run fn; it must raise exactly `exc_type`. Returns the message (printed for the report).

    Only SpecrtError is caught, so any other exception type (an ORT RuntimeError, a bare
    ValueError, an AssertionError) escapes and fails the test as it should."""
    assert issubclass(exc_type, SpecrtError)
    with pytest.raises(SpecrtError) as ei:
        fn(*args, **kw)
    e = ei.value
    assert type(e) is exc_type, f"expected {exc_type.__name__}, got {type(e).__name__}: {e}"
    msg = str(e)
    assert msg.strip(), "the error has no message"
    assert "Traceback" not in msg
    print(f"\n[{exc_type.__name__}] {msg}")
    return msg


def copy_engines(src: Path, tmp_path: Path, name: str = "eng") -> Path:
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def edit_manifest(engine_dir: Path, fn) -> None:
    path = engine_dir / "manifest.json"
    raw = json.loads(path.read_text())
    fn(raw)
    path.write_text(json.dumps(raw, indent=2))


def tokens_of(gen: SpeculativeGenerator, prompt, **kw) -> list[int]:
    return [e.token for e in gen.tokens(list(prompt), **kw)]


def prompt_of(n: int, salt: int = 0) -> list[int]:
    """n ordinary token ids (5..104: characters, no special tokens)."""
    return [(7 * i + 3 * salt) % 100 + 5 for i in range(n)]
