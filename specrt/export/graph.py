"""The one decoder we export: a torch module rebuilt from a Hugging Face state dict
under an `ArchSpec`, written for static shapes and the preallocated KV contract.

KV contract (one graph per T: prefill chunk, decode T=1, verify T=k+1):

    inputs   input_ids  [1, T] int64
             past_len   [1]    int64      tokens already in the cache
             past_k_{i} [1, KVH, M, D]    M = kv capacity (max_context + window)
             past_v_{i} [1, KVH, M, D]
    outputs  logits     [1, T, V]  float32
             new_k_{i}  [1, KVH, T, D]    K/V of the T new tokens (positions past_len..+T)
             new_v_{i}  [1, KVH, T, D]

The caller writes new_k/new_v into the cache at [past_len, past_len + T); rejecting
draft tokens only lowers the length.

Three attention variants (`attention=`):
- "portable": standard ONNX ops only (below); any runtime that reads ONNX runs it.
- "gqa": ONNX Runtime's fused `com.microsoft.GroupQueryAttention` (rotary inside). It
  attends only to the valid length and writes the new K/V into the cache in place: the
  outputs are `present_k_{i}` / `present_v_{i}` [1, KVH, M, D], which the runtime binds
  to the very buffers it passes as `past_*` (past/present share one buffer). ~1.3x
  faster per step on 2 cores at short contexts; ONNX Runtime only.
- "standard": standard ONNX opset-24 ops for TensorRT (whose parser rejects `Attention` with
  past_key/past_value and ORT's contrib ops): per layer `TensorScatter` writes the T new K/V
  rows into the cache inputs at past_len (axis -2) and `Attention` runs over the whole
  cache with a bool mask built from past_len. Outputs `present_k_{i}`/`present_v_{i}`
  [1, KVH, M, D] are the updated cache, bound to the past_* buffers (in place, as "gqa").
  Runs on ONNX Runtime CPU here; TensorRT has not run it (no GPU).

    past_k ─┐
    k_new ──┴─ TensorScatter(axis=-2, write_indices=past_len) ─ present_k ─┐
    q [1, H, T, D] ──────────────────────────────────────────────────────┼─ Attention ─ o [1, H, T, D]
    mask [1, 1, T, M]: j <= past_len + t ───────────────────────────────┘ (GQA: head h reads kv h // G)

Sliding-window layers (Dims.windows) see only j > past_len + t - window: one more mask term
in "portable" and "standard", GroupQueryAttention's local_window_size in "gqa"; the cache
stays full length, so rewinding is still lowering the length.

"portable": cache rows >= past_len are masked, so stale rows
are harmless. Attention never concatenates the cache (that would copy M rows per
layer per step): scores against the cache and against the new block are computed
separately and joined only after the dot products:

    q ──┬─ q·past_kᵀ [.., G*T, M] ─ mask(j < past_len) ─┐
        └─ q·new_kᵀ  [.., G*T, T] ─ mask(causal) ───────┴─ concat ─ softmax ─┬─ [:M] · past_v ─┐
                                                                             └─ [M:] · new_v  ──┴─ + ─ o
"""
from __future__ import annotations

import torch
import torch.onnx.ops
from torch import nn

from specrt.errors import ExportError
from specrt.export.rotary import cos_sin, gqa_table, rotate_half_matrix
from specrt.export.specs import ArchSpec, Dims


def _w(sd: dict, name: str) -> nn.Parameter:
    return _param(sd[name])


class StaticDecoder(nn.Module):
    def __init__(self, spec: ArchSpec, dims: Dims, sd: dict, *, tokens: int, kv_capacity: int,
                 inv_freq: torch.Tensor | None = None, attention_scaling: float = 1.0,
                 attention: str = "portable", dtype: torch.dtype = torch.float32, static_total: bool = False,
                 local_rope: tuple[torch.Tensor, float] | None = None, hidden_layers: tuple[int, ...] = ()):
        # local_rope: (inv_freq, attention_scaling) of the layers whose Dims.rotary is "local"
        # (Gemma 3's sliding layers); inv_freq/attention_scaling are the "global" table
        # hidden_layers: one more output, `hidden_states` [1, T, len(hidden_layers) * hidden] fp32,
        # the outputs of those decoder layers (before the final norm) side by side, for trained
        # draft heads (EAGLE-3 reads three); () exports the graph without it
        super().__init__()
        assert attention in ATTENTION + BATCHED_ONLY, attention
        self.spec, self.dims, self.T, self.M, self.attention = spec, dims, tokens, kv_capacity, attention
        self.hidden_layers = tuple(hidden_layers)
        if sorted(set(self.hidden_layers)) != list(self.hidden_layers) or \
                any(not 0 <= i < dims.layers for i in self.hidden_layers):
            raise ExportError(f"hidden_layers={list(self.hidden_layers)}: give increasing layer indices in "
                              f"0..{dims.layers - 1} (the model has {dims.layers} layers)")
        W = spec.weights
        # lm_head is stored [C, V] so MatMul's B is a plain initializer (quantizable); a tied
        # model gathers its embeddings from the same table by column: one copy of V*C weights
        tied = dims.tied or W["lm_head"] not in sd
        self.lm_head = _param(sd[W["embed" if tied else "lm_head"]].t())
        self.embed = None if tied else _param(sd[W["embed"]])
        self.final_norm = _param(sd[W["final_norm"]].float() + spec.norm_offset)
        self.final_norm_bias = _w(sd, W["final_norm_bias"]) if "final_norm_bias" in W else None
        if spec.positions == "learned":
            self.pos_embed = _w(sd, W["pos_embed"])
        else:
            self.register_buffer("inv_freq", inv_freq.to(torch.float32), persistent=False)
            self.rope_scale = attention_scaling
            # rotary on the first R = 2 * len(inv_freq) dims of each head (R < D: Phi-3's partial rotary)
            R = 2 * len(inv_freq)
            if attention == "gqa" and R < dims.head_dim and (R // 2) % 8:
                raise ExportError(f"the model rotates {R} of {dims.head_dim} head dims; ONNX Runtime's "
                                  "GroupQueryAttention takes a partial rotary table only when R/2 is a multiple of "
                                  "8: build with --attention portable")
            self.register_buffer("rot", rotate_half_matrix(dims.head_dim, R), persistent=False)
            # GroupQueryAttention's rotary tables, one row per cache position: [M, R/2]
            self.register_buffer("cos_cache", gqa_table(torch.cos, inv_freq, attention_scaling, kv_capacity),
                                 persistent=False)
            self.register_buffer("sin_cache", gqa_table(torch.sin, inv_freq, attention_scaling, kv_capacity),
                                 persistent=False)
            if local_rope is not None:
                local_freq, self.rope_scale_local = local_rope
                assert local_freq.shape == inv_freq.shape, "local and global rotary tables differ in size"
                self.register_buffer("inv_freq_local", local_freq.to(torch.float32), persistent=False)
                self.register_buffer("cos_cache_local", gqa_table(torch.cos, local_freq, self.rope_scale_local,
                                                                   kv_capacity), persistent=False)
                self.register_buffer("sin_cache_local", gqa_table(torch.sin, local_freq, self.rope_scale_local,
                                                                   kv_capacity), persistent=False)
        # a window as long as the cache never hides a row: such layers are exported as full attention
        windows = [w if w is not None and w < kv_capacity else None for w in map(dims.window, range(dims.layers))]
        self.layers = nn.ModuleList(_Layer(spec, dims, sd, i, windows[i]) for i in range(dims.layers))
        T, G = tokens, dims.group
        # causal mask of the new block, one copy per query group: [G*T, T]
        causal = torch.tril(torch.ones(T, T, dtype=torch.bool)).repeat(G, 1)
        self.register_buffer("causal", causal, persistent=False)
        self.register_buffer("cache_pos", torch.arange(kv_capacity, dtype=torch.int64), persistent=False)
        self.register_buffer("step_pos", torch.arange(T, dtype=torch.int64), persistent=False)
        self.dtype = dtype
        self.static_total = static_total
        if dtype != torch.float32:
            # weights, rotary tables and the KV cache in `dtype`; inv_freq stays fp32 because
            # rotary angles pos * inv_freq reach max_context radians (fp16 steps of 0.5 there)
            self.to(dtype)
            if spec.positions == "rope":
                self.inv_freq = self.inv_freq.float()
                if local_rope is not None:
                    self.inv_freq_local = self.inv_freq_local.float()

    def example_inputs(self) -> tuple:
        """What torch.onnx.export traces with: zeros of the graph's static input shapes."""
        d, T, M = self.dims, self.T, self.M
        return (torch.zeros(1, T, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
                *[torch.zeros(1, d.kv_heads, M, d.head_dim, dtype=self.dtype) for _ in range(2 * d.layers)])

    def dynamic_shapes(self) -> tuple | None:
        """Symbolic input dims for torch.onnx.export: none, every shape is static."""
        return None

    def forward(self, input_ids, past_len, *past):
        # input_ids: [1, T]; past_len: [1]; past: 2*L tensors [1, KVH, M, D]
        pos = past_len + self.step_pos                                   # [T]
        if self.embed is None:
            # Gather(axis=1) of the T columns, then a [C, T] transpose: indexing lm_head[:, ids]
            # would export Transpose(lm_head), which ONNX Runtime folds into a V*C copy per session
            x = torch.index_select(self.lm_head, 1, input_ids[0]).t().unsqueeze(0)   # [1, T, C]
        else:
            x = self.embed[input_ids[0]].unsqueeze(0)
        if self.dims.embed_scale != 1.0:     # Gemma: sqrt(hidden), after the gather (the table is the LM head)
            x = x * self.dims.embed_scale
        if self.spec.positions == "learned":
            # padded prefill rows may run past the table; they are never read
            x = x + self.pos_embed[pos.clamp(max=self.dims.max_positions - 1)].unsqueeze(0)
        if self.attention == "gqa":
            return self._forward_gqa(x, past_len, past)
        ropes = self._ropes(pos)
        if self.attention == "standard":
            return self._forward_standard(x, past_len, pos, past, ropes)
        masks = self._masks(past_len, pos)
        new_kv, taps = [], []
        for i, layer in enumerate(self.layers):
            x, k, v = layer(x, past[2 * i], past[2 * i + 1], *masks[layer.window], ropes[layer.rotary])
            new_kv += [k, v]
            self._tap(i, x, taps)
        return self._outputs(x, new_kv, taps)

    def _ropes(self, pos) -> dict:
        """Each rotary table the layers use, at positions pos [T]: kind -> (cos [T, D], sin [T, D],
        rotate-half [D, D]), and "none" -> None (learned positions, SmolLM3's layers without rotary)."""
        ropes = {"none": None}
        if self.spec.positions != "rope":
            return ropes
        for kind, (inv_freq, scale) in self._rotary_freqs().items():
            cos, sin = cos_sin(pos, inv_freq, scale, self.dims.head_dim)     # [T, D] (export/rotary.py)
            ropes[kind] = (cos.to(self.dtype), sin.to(self.dtype), self.rot)
        return ropes

    def _rotary_freqs(self) -> dict:
        """kind -> (inv_freq, attention scaling) of each rotary table the layers use."""
        tables = {"global": (self.inv_freq, self.rope_scale)}
        if hasattr(self, "inv_freq_local"):
            tables["local"] = (self.inv_freq_local, self.rope_scale_local)
        return tables

    def _masks(self, past_len, pos) -> dict:
        """Portable attention's masks per sliding window (None: full attention): window ->
        (cache rows [G*T, M] or [M], new block [G*T, T]); query row r is token t = r % T at
        position pos[t], which sees positions j with pos[t] - window < j <= pos[t]."""
        valid = self.cache_pos < past_len                                     # [M]
        masks = {None: (valid, self.causal)}
        G = self.dims.group
        for w in {layer.window for layer in self.layers} - {None}:
            near_past = self.cache_pos[None, :] > (pos - w)[:, None]          # [T, M]
            near_new = self.step_pos[None, :] > self.step_pos[:, None] - w    # [T, T]
            masks[w] = (valid & near_past.repeat(G, 1), self.causal & near_new.repeat(G, 1))
        return masks

    def _forward_gqa(self, x, past_len, past):
        if not torch.onnx.is_in_onnx_export():
            raise RuntimeError("attention='gqa' exists only as an ONNX Runtime graph; use 'portable' in torch")
        # GroupQueryAttention: seqlens_k = total length - 1 (per batch), total_sequence_length scalar
        seqlens = (past_len + (self.T - 1)).to(torch.int32)                   # [1]
        total = (past_len + self.T).to(torch.int32).reshape(())               # []
        if self.static_total:
            # CUDA graphs: GroupQueryAttention reads total_sequence_length on the host, so a value
            # computed on the device would be frozen into a captured graph (or force a sync). A
            # constant M (the buffer length) with the real length in seqlens_k, as onnxruntime-genai
            # does; same results on ORT CPU (tests/gpu_fakes/test_fp16.py).
            total = torch.tensor(self.M, dtype=torch.int32)
        return self._gqa_layers(x, past, seqlens, total)

    def _gqa_layers(self, x, past, seqlens, total):
        """Every layer through GroupQueryAttention (one row here, B rows in export/batch.py), each
        with its rotary cache table (GQA rotates q and k itself); returns (logits, *present)."""
        tables = {"none": None}
        if self.spec.positions == "rope":
            tables["global"] = (self.cos_cache, self.sin_cache)
            if hasattr(self, "cos_cache_local"):
                tables["local"] = (self.cos_cache_local, self.sin_cache_local)
        present, taps = [], []
        for i, layer in enumerate(self.layers):
            x, k, v = layer.forward_gqa(x, past[2 * i], past[2 * i + 1], seqlens, total, tables[layer.rotary])
            present += [k, v]
            self._tap(i, x, taps)
        return self._outputs(x, present, taps)

    def _forward_standard(self, x, past_len, pos, past, ropes):
        # row t may attend to cache rows j <= past_len + t (the cache already holds row t itself),
        # in a sliding-window layer only to j > past_len + t - window
        T, M = self.T, self.M
        causal = self.cache_pos[None, :] <= pos[:, None]                           # [T, M]
        attend = {w: (causal if w is None else causal & (self.cache_pos[None, :] > (pos - w)[:, None]))
                  .reshape(1, 1, T, M) for w in {layer.window for layer in self.layers}}   # [1, 1, T, M] bool
        present, taps = [], []
        for i, layer in enumerate(self.layers):
            x, k, v = layer.forward_standard(x, past[2 * i], past[2 * i + 1], past_len, attend[layer.window],
                                             ropes[layer.rotary])
            present += [k, v]
            self._tap(i, x, taps)
        return self._outputs(x, present, taps)

    def _tap(self, i: int, x, taps: list) -> None:
        if i in self.hidden_layers:
            taps.append(x)

    def _outputs(self, x, kv: list, taps: list) -> tuple:
        """(logits, *K/V) and, with hidden_layers, the tapped layers' outputs [1, T, n * C] fp32."""
        if not self.hidden_layers:
            return (self._head(x), *kv)
        return (self._head(x), *kv, torch.cat(taps, dim=-1).float())

    def _head(self, x):
        return self._logits(self._final_norm(x))

    def _final_norm(self, x):
        return _norm(self.spec, x, self.final_norm, self.final_norm_bias, self.dims.eps)

    def _logits(self, x):
        logits = x @ self.lm_head                                           # [1, T, V]
        logits = logits if logits.dtype == torch.float32 else logits.float()   # logits stay fp32 at the IO
        cap = self.dims.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap   # Gemma 2: cap * tanh(logits / cap)


ATTENTION = ("gqa", "portable", "standard")
BATCHED_ONLY = ("rows",)     # attention variants of the batched graph only (export/batch.py)
IN_PLACE = ("gqa", "standard", "rows")     # graphs whose present_* outputs alias the past_* inputs


def _norm(spec, x, w, b, eps):
    if x.dtype != torch.float32:
        # fp16 graph: statistics in fp32 (x² overflows fp16 beyond |x| = 256), scale in x's dtype
        return _norm(spec, x.float(), w.float(), None if b is None else b.float(), eps).to(x.dtype)
    if spec.norm == "rms":
        # written as ORT's SimplifiedLayerNormalization fusion expects (Pow-ReduceMean-Add-Sqrt-Div)
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w
    return nn.functional.layer_norm(x, (x.shape[-1],), w, b, eps)


# Hugging Face ACT2FN names (specs.ACTIVATIONS) -> the function
ACTIVATION_FNS = {
    "silu": nn.functional.silu,
    "gelu": nn.functional.gelu,
    "gelu_new": lambda x: nn.functional.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: nn.functional.gelu(x, approximate="tanh"),
    "relu": nn.functional.relu,
}


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.detach().to(torch.float32).contiguous(), requires_grad=False)


class _Layer(nn.Module):
    """One block. Linear weights are stored [in, out] (MatMul's B as a plain initializer, so
    quantizers see them), q/k/v are one MatMul and gate/up another: fewer, larger ops.

    What the spec declares shapes the block: q/k norms (qk_norm), norms of the attention and
    MLP outputs (sandwich_norm), the attention scale and soft-cap, this layer's sliding window
    (`window`, None: full attention) and rotary table (`rotary`: "global", "local", "none").

        x ─ norm1 ─ qkv ─ [q/k norm] ─ [rotary] ─ attention ─ o ─ [attn_out_norm] ─ + x ─┐
        ┌─────────────────────────────────────────────────────────────────────────────────┘
        └─ norm2 ─ gate_up ─ act(gate) * up ─ down ─ [mlp_out_norm] ─ + ─ out"""

    def __init__(self, spec: ArchSpec, dims: Dims, sd: dict, i: int, window: int | None = None):
        super().__init__()
        self.spec, self.dims = spec, dims
        self.window, self.rotary = window, dims.rotary_of(i)
        self.scale, self.softcap = dims.scale, dims.attn_softcap
        self.act = ACTIVATION_FNS[dims.act]
        W = {k: v.format(i=i) for k, v in spec.weights.items()}
        get = lambda key: sd[W[key]].to(torch.float32)                     # noqa: E731
        has = lambda key: key in W and W[key] in sd                          # noqa: E731
        # HF Linear stores [out, in]; GPT-2 Conv1D already stores [in, out]
        lin = (lambda key: get(key)) if spec.conv1d else (lambda key: get(key).t())  # noqa: E731
        norm = lambda key: _param(get(key) + spec.norm_offset)             # noqa: E731  Gemma: (1 + w)
        self.norm1, self.norm2 = norm("norm1"), norm("norm2")
        self.norm1_bias = _param(get("norm1_bias")) if has("norm1_bias") else None
        self.norm2_bias = _param(get("norm2_bias")) if has("norm2_bias") else None
        self.attn_out_norm = norm("attn_out_norm") if spec.sandwich_norm else None
        self.mlp_out_norm = norm("mlp_out_norm") if spec.sandwich_norm else None
        # q and k norms as one [H+KVH, D] table: row h scales head h (q heads, then k heads)
        H, KVH = dims.heads, dims.kv_heads
        self.qk_norm = (_param(torch.cat([norm("q_norm").expand(H, -1), norm("k_norm").expand(KVH, -1)]))
                        if spec.qk_norm else None)
        if spec.fused_qkv:
            self.qkv = _param(lin("qkv"))                                             # [C, (H+2KVH)*D]
            self.qkv_b = _param(get("qkv_bias")) if dims.qkv_bias else None
        else:
            self.qkv = _param(torch.cat([lin("q"), lin("k"), lin("v")], dim=1))  # [C, (H+2KVH)*D]
            self.qkv_b = (_param(torch.cat([get("q_bias"), get("k_bias"), get("v_bias")]))
                          if dims.qkv_bias else None)
        self.o = _param(lin("o"))
        self.o_b = _param(get("o_bias")) if has("o_bias") else None
        if spec.mlp == "gated":
            self.gate_up = _param(lin("gate_up") if spec.fused_gate_up
                                  else torch.cat([lin("gate"), lin("up")], dim=1))   # [C, 2I]: gate, up
            self.down = _param(lin("down"))
        else:
            self.fc, self.fc_b = _param(lin("fc")), _param(get("fc_bias"))
            self.proj, self.proj_b = _param(lin("proj")), _param(get("proj_bias"))

    @staticmethod
    def _lin(x, w, b):
        y = x @ w
        return y if b is None else y + b

    def _cap(self, scores):
        # Gemma 2: scores = cap * tanh(scores / cap), after the scale, before the mask
        return scores if self.softcap is None else torch.tanh(scores / self.softcap) * self.softcap

    def _out(self, o):
        # attention output [B, T, H*D] -> the residual branch [B, T, C]
        y = self._lin(o, self.o, self.o_b)
        return y if self.attn_out_norm is None else _norm(self.spec, y, self.attn_out_norm, None, self.dims.eps)

    def forward(self, x, past_k, past_v, valid, causal, rope):
        # x: [B, T, C]; past_k/v: [B, KVH, M, D]; valid: [M] (or [G*T, M] in a sliding-window layer, or per
        # row [B, 1, 1, M] in a batched graph) bool; causal: [G*T, T] bool
        # (B and T are Python ints in a static export, so a B=1 graph is exactly the one-row graph)
        d = self.dims
        B, T, H, KVH, D, G = x.shape[0], x.shape[1], d.heads, d.kv_heads, d.head_dim, d.group
        q, k, v = self._qkv_heads(x, rope)                                       # [B, H, T, D], [B, KVH, T, D]
        # head h reads kv head h // G (HF repeat_kv order): [B, KVH, G*T, D]
        qg = (q * self.scale).reshape(B, KVH, G * T, D)
        s_past = self._cap(qg @ past_k.transpose(-1, -2)).masked_fill(~valid, float("-inf"))  # [B, KVH, G*T, M]
        s_new = self._cap(qg @ k.transpose(-1, -2)).masked_fill(~causal, float("-inf"))       # [B, KVH, G*T, T]
        a = torch.softmax(torch.cat([s_past, s_new], dim=-1), dim=-1)
        M = past_k.shape[2]
        o = a[..., :M] @ past_v + a[..., M:] @ v                                      # [B, KVH, G*T, D]
        o = o.reshape(B, H, T, D).transpose(1, 2).reshape(B, T, H * D)
        return self._mlp(x + self._out(o)), k, v

    def forward_gqa(self, x, past_k, past_v, seqlens, total, rope):
        # x: [B, T, C]; past_k/v: [B, KVH, M, D] (also the present outputs: written in place)
        d = self.dims
        B, T, H, KVH, D = x.shape[0], x.shape[1], d.heads, d.kv_heads, d.head_dim
        h = _norm(self.spec, x, self.norm1, self.norm1_bias, d.eps)
        if self.qk_norm is None:
            q, k, v = self._lin(h, self.qkv, self.qkv_b).split([H * D, KVH * D, KVH * D], dim=-1)
        else:   # normed here, before GroupQueryAttention's rotary (its own q/k norm inputs are CUDA-only)
            qk, v = self._lin(h, self.qkv, self.qkv_b).split([(H + KVH) * D, KVH * D], dim=-1)
            qk = _norm(self.spec, qk.view(B, T, H + KVH, D), self.qk_norm, None, d.eps)   # [B, T, H+KVH, D]
            q, k = qk.reshape(B, T, (H + KVH) * D).split([H * D, KVH * D], dim=-1)
        inputs = [q, k, v, past_k, past_v, seqlens, total] + (list(rope) if rope is not None else [])
        attrs = dict(num_heads=H, kv_num_heads=KVH, scale=self.scale, do_rotary=int(rope is not None),
                     rotary_interleaved=0)
        if self.softcap is not None:
            attrs["softcap"] = float(self.softcap)
        if self.window is not None:
            # the same window as transformers': the last `window` positions, the query's own included
            # (measured: window - 1 fails parity on a tiny Gemma 2)
            attrs["local_window_size"] = self.window
        o, pk, pv = torch.onnx.ops.symbolic_multi_out(
            "com.microsoft::GroupQueryAttention", inputs, attrs,
            dtypes=(x.dtype, x.dtype, x.dtype),
            shapes=((B, T, H * D), tuple(past_k.shape), tuple(past_v.shape)), version=1)
        return self._mlp(x + self._out(o)), pk, pv

    def _qkv_heads(self, x, rope):
        # x: [B, T, C] -> q [B, H, T, D], k/v [B, KVH, T, D], q/k normed, rotary applied
        d = self.dims
        B, T, H, KVH, D = x.shape[0], x.shape[1], d.heads, d.kv_heads, d.head_dim
        h = _norm(self.spec, x, self.norm1, self.norm1_bias, d.eps)
        qkv = self._lin(h, self.qkv, self.qkv_b).view(B, T, H + 2 * KVH, D).transpose(1, 2)  # [B, H+2KVH, T, D]
        qk, v = qkv[:, :H + KVH], qkv[:, H + KVH:]
        if self.qk_norm is not None:
            qk = _norm(self.spec, qk, self.qk_norm[:, None, :], None, d.eps)       # per head: [H+KVH, 1, D]
        if rope is not None:
            cos, sin, rot = rope                                       # [T, D] or per row [B, 1, T, D]; [D, D]
            qk = qk * cos + (qk @ rot) * sin                                       # q and k rotated together
        return qk[:, :H], qk[:, H:], v

    def forward_standard(self, x, past_k, past_v, past_len, attend, rope):
        # x: [B, T, C]; past_k/v: [B, KVH, M, D] (present = past with rows past_len[b].. overwritten)
        d = self.dims
        B, T, H, D = x.shape[0], x.shape[1], d.heads, d.head_dim
        q, k, v = self._qkv_heads(x, rope)
        present_k, present_v = _scatter(past_k, k, past_len), _scatter(past_v, v, past_len)
        o, _, _, _ = torch.onnx.ops.attention(q, present_k, present_v, attend, scale=self.scale,
                                              softcap=float(self.softcap or 0.0))
        o = o.transpose(1, 2).reshape(B, T, H * D)                                 # [B, H, T, D] -> [B, T, H*D]
        return self._mlp(x + self._out(o)), present_k, present_v

    def forward_rows(self, x, past_k, past_v, past_len, pos, bias, rope):
        # x: [B, T, C]; past_k/v: [B, KVH, L, D] (present = past with rows past_len[b].. overwritten);
        # pos [B, T]; attention over all L cache positions given; bias: [B, 1, G*T, L], 0 where a
        # query attends and -inf where it does not (T + 1 rows when G = 1), added to the scores:
        # the same softmax inputs as masking them (s + 0 = s, s - inf = -inf for finite s; a +inf
        # or NaN score, which fp32 CPU graphs do not make, would give NaN where masking gave -inf:
        # an fp16 variant should clamp first), and an Add costs a fraction of a broadcast Where
        # (1x64 prompt chunk at 896 positions: Where was 16% of it);
        # rope: (cos_cache, sin_cache [M, R/2], the eager per-row (cos, sin, rot)) or None
        d = self.dims
        B, T, H, KVH, D, G = x.shape[0], x.shape[1], d.heads, d.kv_heads, d.head_dim, d.group
        h = _norm(self.spec, x, self.norm1, self.norm1_bias, d.eps)
        # the heads of q, k and v in one Reshape and Transpose ([B, H+2KVH, T, D]), then q and k
        # normed (per head) and rotated together: one RotaryEmbedding over the 4-D heads (per-row
        # position_ids; exact per element, as over the 3-D [B, T, (H+KVH)*D], measured bit for bit)
        heads = self._lin(h, self.qkv, self.qkv_b).view(B, T, H + 2 * KVH, D).transpose(1, 2)
        qk, v = heads.split([H + KVH, KVH], dim=1)                                       # [B, H+KVH, T, D]
        if self.qk_norm is not None:
            qk = _norm(self.spec, qk, self.qk_norm[:, None, :], None, d.eps)             # per head: [H+KVH, 1, D]
        if rope is not None and torch.onnx.is_in_onnx_export():
            cos_cache, sin_cache, _ = rope
            qk = torch.onnx.ops.symbolic(
                "com.microsoft::RotaryEmbedding", [qk, pos, cos_cache, sin_cache],
                dict(interleaved=0, num_heads=H + KVH, rotary_embedding_dim=2 * cos_cache.shape[1]),
                dtype=qk.dtype, shape=qk.shape, version=1)
        elif rope is not None:
            cos, sin, rot = rope[2]
            qk = qk * cos + (qk @ rot) * sin
        q, k = qk[:, :H], qk[:, H:]                                                      # v: [B, KVH, T, D]
        present_k, present_v = _scatter(past_k, k, past_len), _scatter(past_v, v, past_len)
        # a kv head's queries as the rows of one MatMul: G*T of them; with one query head per kv head
        # (G = 1) the first query once more (T + 1 rows), so a one-token step still has two rows (a
        # single row takes ONNX Runtime's one-row path, whose sums over the L cache positions round
        # differently as L changes)
        qg = q.reshape(B, KVH, G * T, D) if G > 1 else torch.cat([q, q[:, :, :1]], dim=2)
        s = self._cap((qg @ present_k.transpose(-1, -2)) * self.scale) + bias                # [B, KVH, G*T, L]
        o = torch.softmax(s, dim=-1) @ present_v                                         # [B, KVH, G*T, D]
        if G == 1:
            o = o[:, :, :T]
        o = o.reshape(B, H, T, D).transpose(1, 2).reshape(B, T, H * D)
        return self._mlp(x + self._out(o)), present_k, present_v

    def _mlp(self, x):
        d = self.dims
        h = _norm(self.spec, x, self.norm2, self.norm2_bias, d.eps)
        if self.spec.mlp == "gated":
            gate, up = (h @ self.gate_up).chunk(2, dim=-1)
            m = (self.act(gate) * up) @ self.down
        else:
            m = self._lin(self.act(self._lin(h, self.fc, self.fc_b)), self.proj, self.proj_b)
        if self.mlp_out_norm is not None:
            m = _norm(self.spec, m, self.mlp_out_norm, None, d.eps)
        return x + m


def _scatter(cache, update, past_len):
    """ONNX TensorScatter-24: cache [B, KVH, M, D] with row b's rows past_len[b]..past_len[b]+T
    replaced by update[b] ([B, KVH, T, D]; write_indices = past_len [B]). In torch (outside
    export) an out-of-place index_copy per row, same result."""
    if torch.onnx.is_in_onnx_export():
        return torch.onnx.ops.symbolic("TensorScatter", [cache, update, past_len], dict(axis=-2, mode="linear"),
                                       dtype=cache.dtype, shape=cache.shape, version=24)
    steps = torch.arange(update.shape[2])
    return torch.stack([cache[b].index_copy(1, past_len[b] + steps, update[b]) for b in range(cache.shape[0])])
