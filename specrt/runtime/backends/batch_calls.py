"""The shapes of a batched model's calls, shared by the runtime (ort_batch.py: the buffers and
the padding it binds) and the build's kernel table (builder/gates/kernels.py: the shapes it
times), so the two cannot drift apart: a call padded for a kernel that rounds an odd row apart
(io row_multiple 2), and the prompt chunk of a request alone."""
from __future__ import annotations

import os

from specrt.errors import ConfigError, ManifestError
from specrt.manifest import ModelEntry, Shapes


def padded_call(n: int, T: int, P: int, row_multiple: int) -> tuple[int, int, int]:
    """(rows, tokens, logit positions) of a call of n rows x T tokens (logits at P positions a
    row) as a model whose io row_multiple is 2 runs it: an even number of activation rows and
    of logit rows. One row of several tokens gets one token more (written one past the row's
    own) and one position more; a one-token step (GroupQueryAttention's one-token path must
    stay that path) or several rows get one padding row after them. The kernel table times
    the calls so padded (builder/gates/kernels.py)."""
    if row_multiple > 1 and (n * T % 2 or n * P % 2):
        if n == 1 and T > 1:
            return n, T + T % 2, P + P % 2
        return n + 1, T, P
    return n, T, P


def prompt_call(lengths: list[int], P: int, min_tokens: int, min_rows: int) -> tuple[int, list[int]]:
    """(T, each row's first logit position) of one prompt call whose rows carry chunks of
    `lengths` tokens (runtime/batch/admission.py _prefill_group; the build's gate,
    builder/gates/chunks.py prompt_rows, makes its calls with it): the longest chunk, at least
    min_tokens, P (each row's logits at P positions ending at its last token) and enough for
    min_rows activation rows; shorter chunks are padded at their end."""
    n = len(lengths)
    T = max(max(lengths), min_tokens, P, -(-min_rows // n))
    return T, [max(c - P, 0) for c in lengths]


def lone_prefill_tokens(entry: ModelEntry, shapes: Shapes) -> int:
    """The prompt chunk of a request alone in the engine (no row decoding beside it): the larger
    chunk the build showed gives the same bits as the folder's own (parity.chunk_invariance,
    builder/gates/chunks.py), else the folder's chunk. A larger chunk only when nothing waits on
    the step: beside running rows it would hold their next token that much longer.
    SPECRT_LONE_PREFILL=0 keeps the folder's chunk (the larger call's working memory: server RSS
    +108-115 MiB after long prompts on SmolLM2, docs/benchmarks.md)."""
    v = os.environ.get("SPECRT_LONE_PREFILL", "1").strip().lower()
    if v not in ("1", "true", "yes", "on", "", "0", "false", "no", "off"):
        raise ConfigError(f"SPECRT_LONE_PREFILL={v!r}: expected 1 (a request alone prefills in the larger chunk "
                          "its folder allows) or 0 (always the folder's chunk)")
    rec = (entry.parity or {}).get("chunk_invariance")
    if rec is None or v in ("0", "false", "no", "off"):
        return shapes.prefill_chunk
    chunks = rec.get("chunks") if isinstance(rec, dict) else None
    if not (isinstance(chunks, list) and len(chunks) == 2 and all(type(c) is int and c >= 1 for c in chunks)):
        raise ManifestError(f"models.{entry.role}.parity.chunk_invariance={rec!r}: the manifest was edited; "
                            "rebuild the engines with `specrt build ... --batch`")
    if rec.get("equal") is not True or chunks[0] != shapes.prefill_chunk:
        return shapes.prefill_chunk
    return max(chunks[1], shapes.prefill_chunk)


def min_tokens(entry: ModelEntry, k: int) -> int:
    """Tokens a row of every target pass of the batched engine (prompt chunks too): the windows'
    min_tokens where the build showed speculation cannot change a row's tokens
    (parity.window_invariance: a kernel's one-token path may round apart), else 1."""
    windows = (entry.parity or {}).get("window_invariance") or {}
    if windows.get("equal") is not True:
        return 1
    m = windows.get("min_tokens", 2)
    if not isinstance(m, int) or isinstance(m, bool) or not 1 <= m <= k + 1:
        raise ManifestError(f"models.{entry.role}.parity.window_invariance.min_tokens={m!r} is not a token count in "
                            f"[1, {k + 1}]: the manifest was edited; rebuild the engines with `specrt build ... --batch`")
    return m


def prompt_rows(entry: ModelEntry) -> int:
    """The most requests whose prompt chunks may share one call (runtime/batch/admission.py
    _prefill_group): any number where the build showed a row's prompt gives the same bits among
    others as alone (parity.prompt_rows, builder/gates/chunks.py), else 1 (one row a call:
    folders built before the gate, a GroupQueryAttention prompt graph, other numbers).
    SPECRT_PROMPT_ROWS=N caps it (1: one row a call; a call of more rows holds more working
    memory)."""
    v = os.environ.get("SPECRT_PROMPT_ROWS", "").strip()
    cap = None
    if v:
        try:
            cap = int(v)
        except ValueError:
            cap = 0
        if cap < 1:
            raise ConfigError(f"SPECRT_PROMPT_ROWS={v!r}: expected a positive number of requests whose prompt chunks "
                              "may share one call (1: one a call)")
    rec = (entry.parity or {}).get("prompt_rows")
    if rec is None:
        return 1
    if not isinstance(rec, dict) or "equal" not in rec or rec["equal"] not in (True, False, None):
        raise ManifestError(f"models.{entry.role}.parity.prompt_rows={rec!r}: the manifest was edited; "
                            "rebuild the engines with `specrt build ... --batch`")
    if rec["equal"] is not True:
        return 1
    return cap or 1 << 16
