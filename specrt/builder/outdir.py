"""Where `specrt build` writes: checked before any long work, replaced atomically, and
nothing deleted that the build did not create.

    preflight(out)    refuse a symbolic link, a file, the working folder or its ancestors, a
                      mount point, a folder holding anything (at any depth) but a previous
                      specrt build (unless --force)
    make_partial(out) a fresh hidden sibling `.NAME.partial-XXXX` with a marker file: the
                      build writes there; a unique name never collides with the user's folders.
                      Refused while another live build of the same NAME has its own there
    commit(tmp, out)  swap it into place (the previous build moves to a unique
                      `.NAME.old-XXXX` and is deleted only after the swap succeeded)
    discard(tmp)      remove the partial folder (a failed or interrupted build)
    disk_full(...)    the error for a build that filled its disk: sizes, and what it needs

Ctrl-C and SIGTERM (a `timeout`, a service manager) unwind the build, so `discard` runs.
A build killed outright (SIGKILL, power loss) leaves its marked `.NAME.partial-XXXX`
folder behind; the next build of the same NAME removes it, since the marker says
specrt made it and its process is gone. A partial folder whose builder is alive belongs to a
build still running: it is never removed, and the second build is refused instead (the last
to commit would silently replace the other's output).

Symbolic links inside `--out` are the user's (a build writes none): any link is a foreign
entry, refused without --force; with --force the folder is renamed aside and removed with
`shutil.rmtree`, which unlinks a link and never follows it, so what a link points to is kept.
"""
from __future__ import annotations

import errno
import os
import shutil
import signal
import tempfile
import threading
from pathlib import Path

from specrt import manifest as mf
from specrt.errors import BuildOutputError

MARKER = ".specrt-partial"   # inside every folder a build creates; holds the builder's pid
_SIGTERM_BEFORE: dict[Path, object] = {}   # partial folder -> the SIGTERM handler in place before it


def preflight(out: str | Path, *, force: bool = False) -> Path:
    """Check `out` before the build starts; returns it as an absolute path."""
    if str(out).strip() == "":
        raise BuildOutputError("--out is empty: name a new folder, e.g. --out artifacts/mine")
    path = Path(os.path.abspath(Path(out).expanduser()))
    if path.is_symlink():
        raise BuildOutputError(f"--out {out} is a symbolic link (to {os.readlink(path)}); the build swaps its output "
                               "folder in with a rename, which would replace the link, not the folder it points to: "
                               f"give the folder itself, e.g. --out {path.resolve()}")
    cwd = Path.cwd()
    if path == cwd or path in cwd.parents or path.parent == path:
        raise BuildOutputError(f"--out {out} is the current folder or one of its parents; the build replaces its "
                               "output folder as a whole: name a new subfolder, e.g. --out artifacts/mine")
    if path.exists() and not path.is_dir():
        raise BuildOutputError(f"--out {out} is an existing file, not a folder: choose another --out "
                               "(the build writes a folder)")
    if path.is_dir():
        if os.path.ismount(path):
            raise BuildOutputError(f"--out {out} is a mount point; the build swaps its output folder in with a "
                                   f"rename, which a mount point does not allow: use a subfolder, e.g. --out "
                                   f"{Path(out) / 'engines'}")
        foreign = foreign_entries(path)
        if foreign and not force:
            shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
            kind = "is not a specrt engine folder" if not (path / mf.FILENAME).is_file() else \
                "holds files that specrt did not write"
            raise BuildOutputError(f"--out {out} {kind} ({shown}); the build would replace it: choose a new "
                                   "folder, move those files away, or pass --force to replace the folder and "
                                   "everything in it")
    return path


def foreign_entries(folder: Path) -> list[str]:
    """Entries of `folder` a previous specrt build did not write (all of them when it holds
    no readable specrt manifest). A symbolic link is always foreign, even under an artifact's
    name: a build writes plain files, so a link is something the user put there."""
    # rglob does not descend into linked folders: a link is listed once, by its own name
    paths = [p for p in folder.rglob("*") if p.is_file() or p.is_symlink()]
    entries = sorted(str(p.relative_to(folder)) for p in paths)
    if not entries:
        return []
    links = {str(p.relative_to(folder)) for p in paths if p.is_symlink()}
    try:
        man = mf.load(folder)
    except mf.ManifestError:
        return entries
    known = ({mf.FILENAME} | {rel for rel, _ in mf.artifact_files(man)}) - links
    return [e for e in entries if e not in known]


def make_partial(out: Path) -> Path:
    """Create the hidden folder the build writes into, next to `out` (same file system, so
    the final move is a rename). Fails here, before the long work, if `out` is unwritable."""
    parent = out.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=parent))
        (tmp / MARKER).write_text(str(os.getpid()))
        # after our own marker is written: of two builds starting together, at least one sees
        # the other and refuses, so two never both run into the same --out
        running = _clear_partials(out, tmp)
    except OSError as e:
        raise BuildOutputError(f"cannot write a build next to {out} ({e.strerror or e}): choose an --out in a "
                               "writable folder") from None
    if running is not None:
        folder, pid = running
        shutil.rmtree(tmp, ignore_errors=True)
        raise BuildOutputError(f"another specrt build (process {pid}) is writing --out {out} (into {folder}); "
                               "wait for it to finish, or choose another --out. If no build is running (the "
                               f"process id was reused), remove {folder} and build again")
    if threading.current_thread() is threading.main_thread():
        # until discard(tmp): SIGTERM (timeout, kill, a service manager) unwinds the build
        # like Ctrl-C, so the caller's `finally: discard(tmp)` removes the partial folder
        _SIGTERM_BEFORE[tmp] = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    return tmp


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)     # 143, the exit status of a process ended by SIGTERM


def commit(tmp: Path, out: Path) -> None:
    """Move the finished build `tmp` to `out`; the previous build survives a failure, and
    `tmp` keeps its marker then (so `discard` still removes it)."""
    marker = (tmp / MARKER).read_text()
    (tmp / MARKER).unlink(missing_ok=True)
    old, moved = None, False
    try:
        if out.is_dir() and not out.is_symlink() and not any(out.iterdir()):
            out.rmdir()          # an empty folder (e.g. made by the user for the build) holds nothing to keep
        if out.exists() or out.is_symlink():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old)   # onto the empty unique folder: atomic, never someone else's name
            moved = True
        os.replace(tmp, out)
    except OSError as e:
        if moved and not out.exists():
            os.replace(old, out)
        elif old is not None and not moved:
            old.rmdir()            # still the empty folder made above
        if tmp.is_dir():
            (tmp / MARKER).write_text(marker)
        raise BuildOutputError(f"could not move the finished build into {out} ({e.strerror or e}); the previous "
                               "contents are unchanged: check the folder's permissions, or choose another --out") \
            from None
    if moved:
        shutil.rmtree(old, ignore_errors=True)


def discard(tmp: Path) -> None:
    """Remove a build folder this process created (only if it carries the marker), and give
    SIGTERM back its previous handler."""
    if (tmp / MARKER).is_file():
        shutil.rmtree(tmp, ignore_errors=True)
    if tmp in _SIGTERM_BEFORE and threading.current_thread() is threading.main_thread():
        before = _SIGTERM_BEFORE.pop(tmp)
        signal.signal(signal.SIGTERM, signal.SIG_DFL if before is None else before)


def disk_full(err: OSError, out: Path, tmp: Path) -> BuildOutputError | None:
    """The error to raise for a build that ran out of disk space (None for any other OSError):
    how much it had written, what is free, and roughly what it needs. Call before discard(tmp)."""
    if err.errno != errno.ENOSPC:
        return None
    written = sum(p.stat().st_size for p in tmp.rglob("*") if p.is_file() and not p.is_symlink())
    free = shutil.disk_usage(tmp if tmp.exists() else out.parent).free
    try:    # a previous build of the same kind in `out` is the best estimate
        man = mf.load(out)
        previous = sum((out / rel).stat().st_size for rel, _ in mf.artifact_files(man))
    except (mf.ManifestError, OSError):
        previous = 0
    need = (f"about {previous / 1e6:.0f} MB, the size of the previous build in {out}" if previous > written else
            f"more than the {written / 1e6:.0f} MB it had written (an fp32 target takes ~4 bytes per parameter, "
            "its int8 draft ~1 more; the default SmolLM2-135M build takes ~520 MB)")
    return BuildOutputError(f"the disk is full (no space left on the device holding {out.parent}): the build had "
                            f"written {written / 1e6:.0f} MB when it failed, {free / 1e6:.0f} MB more were free; it "
                            f"needs {need}. The partial build is removed: free space on that disk, or choose an "
                            "--out on another one")


def _clear_partials(out: Path, mine: Path) -> tuple[Path, int] | None:
    """Remove the partial folders of `out` whose builder is dead; returns (folder, pid) of one
    whose builder is alive (another build still running; this process's own count too, a
    build in another thread), or None."""
    running = None
    for p in out.parent.glob(f".{out.name}.partial-*"):
        if p == mine or p.is_symlink():
            continue               # a link is the user's, whatever its name
        try:
            pid = int((p / MARKER).read_text().strip())
        except (OSError, ValueError):
            continue               # not ours: leave it alone
        if pid == os.getpid() or _alive(pid):
            running = running or (p, pid)
        else:
            shutil.rmtree(p, ignore_errors=True)
    return running


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
