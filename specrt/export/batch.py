"""Graphs with a batch dimension: B sequences in one call, each row at its own position.

The per-row generalisation of graph.py's KV contract (B static or the symbolic dim "batch",
T static or the symbolic dim "tokens"):

    inputs   input_ids  [B, T] int64
             past_len   [B]    int64      tokens already in row b's cache
             logit_pos  [B, P] int64      which of row b's T positions get logits (P symbolic)
             past_k_{i} [B, KVH, M, D]    M = kv capacity ("rows": symbolic, the positions bound);
                                          row b is sequence b's cache
             past_v_{i} [B, KVH, M, D]
    outputs  logits     [B, P, V]  float32    logits[b, p] = the logits at position logit_pos[b, p]
             hidden_states [B, T, n*C] float32       with hidden_layers: those layers' outputs, every position
             present_k_{i}/present_v_{i} [B, KVH, M, D]   "gqa", "standard": the cache, in place
             new_k_{i}/new_v_{i}         [B, KVH, T, D]   "portable": returned, the caller writes them

Row b's tokens sit at positions past_len[b] .. past_len[b]+T-1; the row attends to its own
cache rows [0, past_len[b]) and causally within its window, never to another row. A row with
fewer than T real tokens is padded at its end: the padding writes K/V past the row's length,
where nothing reads it (as today's padded prefill chunk). At B=1 the inputs and outputs are
exactly graph.py's one-row contract, with logit_pos = [[0..T-1]].

logit_pos: a prefill chunk needs the logits of its last position only, and the LM head
(V x C) is ~20% of a chunk's cost; decode and verify windows bind all T positions. The
positions are gathered after the final norm (which stays fused with the last residual Add),
so the LM head runs over B*P rows. Every row's logits are computed by the same kernels as
before; callers keep the LM head's rows >= the manifest's min_rows (builder/gates/rows.py).

Per variant, what carries the rows' lengths:
- "gqa": GroupQueryAttention's seqlens_k [B] int32 = past_len + T - 1 (row b's total length
  minus one) and total_sequence_length = max_b past_len[b] + T (or the constant M with
  static_total, for CUDA-graph capture); rotary positions come from seqlens_k per row. With
  grow_cache (the int8 self-draft's one-token graph beside a "rows" step graph) M is symbolic
  as in "rows": the op reads each row's own length, whatever the bound cache's length.
- "standard": TensorScatter's write_indices = past_len [B] (row b's new K/V at its own
  offset) and an Attention mask [B, 1, T, M]: j <= past_len[b] + t.
- "portable": a cache mask [B, 1, 1, M]: j < past_len[b], and the causal mask of the window.
- "rows": M is symbolic ("kv_len"): the graph attends to every cache position it is given
  (masked per row, j <= past_len[b] + t), and the runtime binds a cache of just the positions
  its rows use, rounded up to a block (runtime/backends/batch_kv.py BatchKV grows and shrinks
  it), so no call copies a prefix of a larger cache (ONNX Runtime has no strided views: a
  `Slice` of present[:, :, :L] copied L positions of every row, K and V, in every layer).

Sliding-window layers (Gemma 2/3, Mistral with a window shorter than the cache): "gqa"
through GroupQueryAttention's local_window_size (graph.py's layers, unchanged), "standard"
with one more mask term per row, j > past_len[b] + t - window; "portable" refuses them.

    past_len [B] ─┬─ + arange(T) ─ pos [B, T] ─ rotary / learned positions / masks
                  └─ (gqa) + T - 1 ─ seqlens_k [B] int32;  max + T ─ total_sequence_length
"""
from __future__ import annotations

import torch

from specrt.errors import ExportError
from specrt.export.graph import StaticDecoder
from specrt.export.rotary import cos_sin

DYNAMIC = "dynamic"
BATCH_DIM, TOKENS_DIM, POSITIONS_DIM, KV_DIM = "batch", "tokens", "positions", "kv_len"   # the ONNX names of the symbolic dims
# example sizes the exporter traces a symbolic dim with: >= 2 (torch.export specialises 0 and 1)
# and different from each other, so no guard can tie B to T or P
TRACE_BATCH, TRACE_TOKENS, TRACE_POSITIONS, TRACE_KV = 2, 3, 4, 16


class BatchedDecoder(StaticDecoder):
    """StaticDecoder over [B, T] ids with per-row past lengths.

    batch: an int (static B, the GPU buckets) or "dynamic" (symbolic "batch", ONNX Runtime CPU).
    tokens: an int (static T) or "dynamic" (symbolic "tokens": one graph for prefill chunks,
    decode and verify windows)."""

    def __init__(self, spec, dims, sd, *, batch: int | str, tokens: int | str, kv_capacity: int,
                 grow_cache: bool | None = None, **kw):
        """grow_cache: the cache's position axis is symbolic ("kv_len": the runtime binds the
        positions its rows use, runtime/backends/batch_kv.py); default: "rows" graphs only. A
        "gqa" graph may take such a cache too (the int8 self-draft's one-token steps over a
        "rows" target's cache: GroupQueryAttention reads each row's own length, whatever L is,
        and writes in place when present is bound to past)."""
        for name, v in (("batch", batch), ("tokens", tokens)):
            assert v == DYNAMIC or (isinstance(v, int) and v >= 1), (name, v)
        super().__init__(spec, dims, sd, tokens=tokens if tokens != DYNAMIC else TRACE_TOKENS,
                         kv_capacity=kv_capacity, **kw)
        if self.attention == "portable" and any(layer.window is not None for layer in self.layers):
            raise ExportError("the model has sliding-window layers, which the batched portable graph does not "
                              "export: build with --attention gqa (the default) or standard")
        self.grow_cache = self.attention == "rows" if grow_cache is None else grow_cache
        if self.grow_cache and (self.attention not in ("rows", "gqa") or self.static_total):
            raise ExportError(f"a cache of symbolic length is exported for 'rows' and 'gqa' (without a static total "
                              f"length) graphs, not attention={self.attention!r}")
        self.B, self.T = batch, tokens
        del self.causal, self.step_pos      # built in the graph from T (which may be symbolic)

    def example_inputs(self) -> tuple:
        d = self.dims
        B = TRACE_BATCH if self.B == DYNAMIC else self.B
        T = TRACE_TOKENS if self.T == DYNAMIC else self.T
        return (torch.zeros(B, T, dtype=torch.int64), torch.zeros(B, dtype=torch.int64),
                torch.zeros(B, TRACE_POSITIONS, dtype=torch.int64),
                *[torch.zeros(B, d.kv_heads, TRACE_KV if self.grow_cache else self.M, d.head_dim,
                              dtype=self.dtype) for _ in range(2 * d.layers)])

    def dynamic_shapes(self) -> tuple:
        """input_ids {0: batch, 1: tokens}, past_len {0: batch}, logit_pos {0: batch, 1:
        positions}, caches {0: batch} (grow_cache: {0: batch, 2: kv_len}): named dims, so the ONNX
        graph's inputs and outputs read [batch, tokens] / [batch, 3, M, 64]. P is symbolic even
        in a static bucket."""
        b = {0: BATCH_DIM} if self.B == DYNAMIC else {}
        t = {1: TOKENS_DIM} if self.T == DYNAMIC else {}
        kv = {**b, 2: KV_DIM} if self.grow_cache else dict(b)
        # structured as forward's parameters: input_ids, past_len, logit_pos, then *past as one tuple
        return ({**b, **t}, dict(b), {**b, 1: POSITIONS_DIM}, tuple(dict(kv) for _ in range(2 * self.dims.layers)))

    def forward(self, input_ids, past_len, logit_pos, *past):
        # input_ids: [B, T]; past_len: [B]; logit_pos: [B, P]; past: 2*L tensors [B, KVH, M, D]
        B, T = input_ids.shape
        self._positions = logit_pos
        pos = past_len[:, None] + torch.arange(T)[None, :]                    # [B, T]
        x = self._embed(input_ids, pos)                                       # [B, T, C]
        if self.attention == "gqa":
            return self._rows_gqa(x, past_len, T, past)
        ropes = self._ropes_rows(pos)
        if self.attention == "rows":
            return self._rows_masked(x, past_len, pos, past, ropes)
        if self.attention == "standard":
            # row b's token t attends to cache rows j <= pos[b, t]; in a sliding-window layer only
            # to j > pos[b, t] - window (graph.py's _forward_standard, per row)
            causal = self.cache_pos[None, None, :] <= pos[:, :, None]                     # [B, T, M]
            attend = {w: (causal if w is None else causal & (self.cache_pos[None, None, :] > (pos - w)[:, :, None]))
                      .unsqueeze(1) for w in {layer.window for layer in self.layers}}    # [B, 1, T, M] bool
            present, taps = [], []
            for i, layer in enumerate(self.layers):
                x, k, v = layer.forward_standard(x, past[2 * i], past[2 * i + 1], past_len, attend[layer.window],
                                                 ropes[layer.rotary])
                present += [k, v]
                self._tap(i, x, taps)
            return self._outputs(x, present, taps)
        valid = (self.cache_pos[None, :] < past_len[:, None]).reshape(B, 1, 1, self.M)   # [B, 1, 1, M]
        steps = torch.arange(T)
        causal = (steps[None, :] <= steps[:, None]).repeat(self.dims.group, 1)   # [G*T, T]: query group-major
        new_kv, taps = [], []
        for i, layer in enumerate(self.layers):
            x, k, v = layer(x, past[2 * i], past[2 * i + 1], valid, causal, ropes[layer.rotary])
            new_kv += [k, v]
            self._tap(i, x, taps)
        return self._outputs(x, new_kv, taps)

    def _rows_masked(self, x, past_len, pos, past, ropes):
        # the cache as bound: L positions (L >= every row's length + T, any L: a row's logits do
        # not depend on it); each row's new K/V are written in place first (TensorScatter), then
        # its queries, grouped per kv head ([B, KVH, G*T, D]: G*T >= 2 rows in every MatMul; G = 1:
        # the first query once more), attend to all L positions, masked per row: j <= pos[b, t]
        # (and > pos - window)
        G = self.dims.group
        L = past[0].shape[2]
        kv_pos = torch.arange(L, dtype=torch.int64)
        causal = kv_pos[None, None, :] <= pos[:, :, None]                                 # [B, T, L]

        def rows(m):    # the mask of each query row (graph.py's forward_rows): G*T, or T + 1 when G = 1
            return (m.repeat(1, G, 1) if G > 1 else torch.cat([m, m[:, :1]], dim=1)).unsqueeze(1)
        # the mask as an additive bias, made once per window kind (one Where a call, not one a layer)
        zero, minus_inf = torch.zeros((), dtype=x.dtype), torch.full((), float("-inf"), dtype=x.dtype)
        attend = {w: torch.where(rows(causal if w is None else causal & (kv_pos[None, None, :] > (pos - w)[:, :, None])),
                                 zero, minus_inf)
                  for w in {layer.window for layer in self.layers}}                     # [B, 1, G*T, L]
        tables = {"none": None}
        if self.spec.positions == "rope":
            tables["global"] = (self.cos_cache, self.sin_cache, ropes["global"])
            if hasattr(self, "cos_cache_local"):
                tables["local"] = (self.cos_cache_local, self.sin_cache_local, ropes["local"])
        present, taps = [], []
        for i, layer in enumerate(self.layers):
            x, k, v = layer.forward_rows(x, past[2 * i], past[2 * i + 1], past_len, pos, attend[layer.window],
                                         tables[layer.rotary])
            present += [k, v]
            self._tap(i, x, taps)
        return self._outputs(x, present, taps)

    def _head(self, x):
        # [B, T, C] -> the final norm over all T -> the P rows of logit_pos -> logits [B, P, V]
        x = self._final_norm(x)
        idx = self._positions[:, :, None].expand(-1, -1, x.shape[-1])          # [B, P, C]
        return self._logits(torch.gather(x, 1, idx))

    def _embed(self, input_ids, pos):
        # [B, T] ids -> [B, T, C]; a tied model gathers columns of the [C, V] head
        B, T = input_ids.shape
        if self.embed is None:
            # Gather(axis=1), not lm_head[:, ids] (a Transpose of the table: a V*C copy per session)
            x = torch.index_select(self.lm_head, 1, input_ids.reshape(-1)).t().reshape(B, T, -1)
        else:
            x = self.embed[input_ids]
        if self.dims.embed_scale != 1.0:     # Gemma: sqrt(hidden), after the gather
            x = x * self.dims.embed_scale
        if self.spec.positions == "learned":
            # padded rows may run past the table; they are never read
            x = x + self.pos_embed[pos.clamp(max=self.dims.max_positions - 1)]
        return x

    def _ropes_rows(self, pos) -> dict:
        # pos [B, T] -> per rotary kind (graph.py's _ropes): cos, sin [B, 1, T, D] (broadcast over
        # heads), the rotate-half matrix [D, D]; "none": layers without rotary
        ropes = {"none": None}
        if self.spec.positions != "rope":
            return ropes
        B, T = pos.shape
        for kind, (inv_freq, scale) in self._rotary_freqs().items():
            cos, sin = cos_sin(pos.reshape(-1), inv_freq, scale, self.dims.head_dim)     # [B*T, D]
            ropes[kind] = (cos.reshape(B, 1, T, -1).to(self.dtype), sin.reshape(B, 1, T, -1).to(self.dtype),
                           self.rot)
        return ropes

    def _rows_gqa(self, x, past_len, T, past):
        if not torch.onnx.is_in_onnx_export():
            raise RuntimeError("attention='gqa' exists only as an ONNX Runtime graph; use 'portable' in torch")
        seqlens = (past_len + (T - 1)).to(torch.int32)                           # [B]: row b's total - 1
        total = (past_len.max() + T).to(torch.int32)                             # []: the longest row's total
        if self.static_total:
            total = torch.tensor(self.M, dtype=torch.int32)   # see StaticDecoder._forward_gqa
        return self._gqa_layers(x, past, seqlens, total)
