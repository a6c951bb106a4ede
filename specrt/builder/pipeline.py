"""`specrt build`: one BuildConfig -> one engine folder with its manifest.

    build(cfg)
      backend.resolve(cfg)       --backend auto -> a backend; every GPU refusal, before any work
      outdir.preflight(out)      --out is refused before the long work if specrt may not replace it
      configure_threads          every session of the build runs on the configured pool
      cpu.build_cpu | gpu.build_gpu   into a hidden partial sibling of out
      outdir.commit              swapped into place only when every gate passed

A failed or interrupted build leaves `out` as it was, and nothing is deleted that specrt did
not create (`force=True` replaces a folder that is not a previous build).
"""
from __future__ import annotations

from pathlib import Path

from specrt.builder import backend, outdir
from specrt.builder.config import BuildConfig


def build(cfg: BuildConfig, *, progress: bool = True, force: bool = False) -> Path:
    """Build `cfg` into `cfg.out` (see the module docstring); returns the folder."""
    from specrt.runtime.backends.ort_cpu import configure_threads
    cfg, choice = backend.resolve(cfg, progress=progress)
    out = outdir.preflight(cfg.out, force=force)
    configure_threads(cfg.threads)
    tmp = outdir.make_partial(out)
    try:
        if cfg.backend == "ort-cpu":
            from specrt.builder.cpu import build_cpu
            build_cpu(cfg, out, tmp, progress, choice)
        else:
            from specrt.builder.gpu import build_gpu
            build_gpu(cfg, out, tmp, progress, choice)
        outdir.commit(tmp, out)
    except OSError as e:           # ENOSPC: say that the disk is full and what the build needs
        full = outdir.disk_full(e, out, tmp)
        if full is None:
            raise
        raise full from None
    finally:
        outdir.discard(tmp)        # a failed build leaves nothing behind; `out` is untouched
    return Path(cfg.out)
