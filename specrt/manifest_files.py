"""The files a manifest names: where they may be, that they exist, and their hashes.

An engine folder is something people download and share, so it may only name files
inside itself: every `file` field is a relative path without `..`, and what it
resolves to (symbolic links followed) lies inside the folder. `confine` checks this at
load, before anything is opened; `check_files` and `HashCheck` then check existence,
sizes and sha256.

    field (as a user would write it)          what it names
    models.<role>.weights.file                the weights every graph of the model reads
    models.<role>.graphs.<graph>.file         an ONNX graph
    models.<role>.graphs.<graph>.engine.file  a TensorRT engine (GPU builds)
    tokenizer.file                            tokenizer.json
    proposers.<name>.file                     a shipped proposal table (n-grams)

Pure stdlib, like manifest.py (which re-exports these names).
"""
from __future__ import annotations

import hashlib
import threading
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

from specrt.errors import GraphFileError, ManifestError

Manifest = Any   # specrt.manifest.Manifest (not imported: manifest.py imports this module)

VERIFY_MODES = ("full", "none")


def file_fields(man: Manifest) -> list[tuple[str, str, str]]:
    """(field, relative path, sha256) of every file the manifest names."""
    out = [(f"models.{role}.weights.file", m.weights["file"], m.weights["sha256"]) for role, m in man.models.items()]
    for role, m in man.models.items():
        for g, e in m.graphs.items():
            out.append((f"models.{role}.graphs.{g}.file", e.file, e.sha256))
            if e.engine is not None:
                out.append((f"models.{role}.graphs.{g}.engine.file", e.engine["file"], e.engine["sha256"]))
    out.append(("tokenizer.file", man.tokenizer["file"], man.tokenizer["sha256"]))
    out += [(f"proposers.{name}.file", e["file"], e["sha256"]) for name, e in (man.proposers or {}).items()]
    return out


def artifact_files(man: Manifest) -> list[tuple[str, str]]:
    """(relative path, sha256) of every file the manifest names."""
    return [(rel, digest) for _, rel, digest in file_fields(man)]


def confine(man: Manifest, root: Path, manifest_path: Path) -> None:
    """Refuse any named file that is not a plain relative path inside `root` once symbolic
    links are resolved: a ManifestError naming the field."""
    inside = root.resolve()
    for field, rel, _ in file_fields(man):
        why = _outside(rel, root, inside)
        if why:
            raise ManifestError(
                f"{manifest_path}: {field}={rel!r} {why}; an engine folder may only name files inside itself "
                "(specrt never reads outside it): restore the manifest or rebuild the engines, and if a file "
                "must live elsewhere, copy it into the folder")


def _outside(rel: str, root: Path, inside: Path) -> str | None:
    """Why `rel` may not be opened from `root` (None: it may)."""
    if not rel or "\x00" in rel:
        return "is empty or holds a NUL character"
    posix, windows = PurePosixPath(rel), PureWindowsPath(rel)
    if posix.is_absolute() or windows.is_absolute() or windows.drive:
        return "is an absolute path"
    if ".." in posix.parts or ".." in windows.parts:
        return "climbs out of the folder with '..'"
    try:
        target = (root / rel).resolve()
    except (OSError, RuntimeError) as e:        # RuntimeError: a symbolic-link loop (Python < 3.13)
        return f"cannot be resolved ({e})"
    if target != inside and inside not in target.parents:
        return f"is (or lies under) a symbolic link that leads outside the folder, to {target}"
    return None


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def check_files(man: Manifest, directory: Path, *, hashes: bool = False) -> None:
    """Every file the manifest names exists (and, with hashes=True, matches its sha256)."""
    sizes = {m.weights["file"]: m.weights["bytes"] for m in man.models.values()}
    sizes.update({g.engine["file"]: g.engine["bytes"] for m in man.models.values() for g in m.graphs.values()
                  if g.engine is not None})
    sizes.update({e["file"]: e["bytes"] for e in (man.proposers or {}).values()})
    for rel, digest in artifact_files(man):
        p = Path(directory) / rel
        if not p.is_file():
            raise GraphFileError(f"{p} is named by the manifest but missing: rebuild the engines")
        if rel in sizes and p.stat().st_size != sizes[rel]:
            raise GraphFileError(f"{p} has {p.stat().st_size} bytes, the manifest says {sizes[rel]}: the file is "
                                 "truncated or replaced; rebuild the engines")
        if hashes and sha256_file(p) != digest:
            raise GraphFileError(f"{p} does not match the sha256 in the manifest (corrupt or replaced): rebuild the engines")


class HashCheck:
    """sha256 of every artifact, computed in a background thread.

    Hashing the default engines' ~770 MB takes ~0.6 s on one core; hashlib releases the
    GIL, so it runs while ONNX Runtime builds its sessions. `result()` waits and raises
    GraphFileError naming the first file that does not match (zeroed blocks, a graph
    copied over another of the same size, an edited tokenizer).
    """

    def __init__(self, man: Manifest, directory: Path):
        self.directory = Path(directory)
        self.bad: list[str] = []
        self.error: str | None = None
        self._thread = threading.Thread(target=self._run, args=(artifact_files(man),), name="specrt-verify",
                                        daemon=True)
        self._thread.start()

    def _run(self, entries) -> None:
        for rel, digest in entries:
            try:
                if sha256_file(self.directory / rel) != digest:
                    self.bad.append(rel)
            except OSError as e:
                self.error = f"{self.directory / rel} cannot be read ({e.strerror})"
                return

    def result(self) -> None:
        self._thread.join()
        if self.error:
            raise GraphFileError(f"{self.error}: check the engine folder, or rebuild the engines")
        if self.bad:
            paths = ", ".join(str(self.directory / b) for b in self.bad)
            raise GraphFileError(f"{paths} {'does' if len(self.bad) == 1 else 'do'} not match the sha256 in the "
                                 "manifest (damaged or replaced): rebuild the engines (`specrt build`, or "
                                 "`make engines` for the default ones)")
