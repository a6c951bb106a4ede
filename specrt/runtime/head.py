"""A trained draft head (`specrt train-draft`, specrt/heads/) at run time: its folder, checked,
and its graphs over a cache of rows, for the batched engine (runtime/batch/engine.py).

    folder     head.json (format "specrt-eagle-head"), head_fc.onnx, head.onnx, vocab_map.npy:
               plain file names inside the folder, each with its sha256 in head.json
    cache      K and V of its one layer: [rows, KVH, capacity, D] each, allocated once; row r
               holds pairs (feature of position p, token p+1) for p < the row's head_len
    fc         the target's tapped layers [N, n*h] -> the pair feature [N, h]
    step       rows 0..n-1: hidden [n, T, h], tokens [n, T], starts [n] (the row's head_len),
               positions [n, 1] -> (logits [n, Vd] at those positions, hidden_out [n, T, h]);
               each row's T new K/V are written at starts[i] (padding past a row's own pairs
               lands where nothing reads it)

    open_for_batch(...)  the HeadModel and the batch policy that drafts with it, for open_batch(head=)

The head reads the target's own hidden states, so the folder it drafts for must return the
same layers (`specrt build --batch --hidden-layers ...`): checked when it is opened. What it
proposes never changes a token: the target verifies every one (runtime/choice.py).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from specrt.errors import ConfigError, GraphFileError, ManifestError
from specrt.manifest_files import sha256_file
from specrt.runtime.kv import lazy_zeros

FORMAT, VERSION = "specrt-eagle-head", 1
FILES = ("fc", "head", "vocab_map")


def read_head(folder: str | Path) -> tuple[Path, dict]:
    """(folder, head.json) after checking its structure and that every file it names is a plain
    name inside the folder with the recorded sha256."""
    root = Path(folder)
    path = root / "head.json"
    if not path.is_file():
        raise ConfigError(f"{root} has no head.json: give a folder written by `specrt train-draft`")
    if path.is_symlink():
        raise ManifestError(f"{path} is a symbolic link: a head folder holds its own head.json (train it again with "
                            "`specrt train-draft`)")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ManifestError(f"{path} is not JSON ({e}): train the head again with `specrt train-draft`") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ManifestError(f"{path} is not a specrt head of format {FORMAT} version {VERSION}: train it again with "
                            "this specrt's `specrt train-draft`")
    cfg, files, layers = meta.get("config"), meta.get("files"), meta.get("layers")
    need = ("hidden", "n_feats", "kv_heads", "head_dim", "draft_vocab")
    if not isinstance(cfg, dict) or any(not isinstance(cfg.get(k), int) or isinstance(cfg.get(k), bool)
                                        or not 1 <= cfg[k] <= (1 << 20) for k in need):
        raise ManifestError(f"{path}: config must give integers in [1, 2^20] for {', '.join(need)}; the file was "
                            "edited")
    if not isinstance(meta.get("acceptance", {}), dict) or not isinstance(meta.get("costs_ms", {}), dict):
        raise ManifestError(f"{path}: acceptance and costs_ms must be objects; the file was edited")
    if not isinstance(layers, list) or len(layers) != cfg["n_feats"] or \
            any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in layers):
        raise ManifestError(f"{path}: layers={layers!r} must list config.n_feats target layer indices")
    if not isinstance(files, dict) or set(files) != set(FILES):
        raise ManifestError(f"{path}: files must name exactly {', '.join(FILES)}; the file was edited")
    for name in FILES:
        f = files[name]
        fname = f.get("file") if isinstance(f, dict) else None
        if not isinstance(fname, str) or not fname or Path(fname).name != fname or fname in (".", ".."):
            raise ManifestError(f"{path}: files.{name}.file={fname!r} must be a plain file name inside {root}")
        p = root / fname
        if not p.is_file() or p.is_symlink():
            raise GraphFileError(f"{p} is missing (or a link): train the head again with `specrt train-draft`")
        if sha256_file(p) != f.get("sha256"):
            raise GraphFileError(f"{p} does not match its sha256 in {path}: the file changed since training; train "
                                 "the head again")
    return root, meta


def check_head_for(meta: dict, entry, folder: Path) -> None:
    """The engine folder's batched model returns the layers the head reads, at its width."""
    d = entry.dims
    have = list(d.get("hidden_layers") or [])
    if have != meta["layers"]:
        flag = ",".join(map(str, meta["layers"]))
        raise ConfigError(f"the head in {folder} reads target layers {meta['layers']}, but this engine folder's batched "
                          f"model returns {have or 'no hidden states'}: rebuild it with `specrt build ... --batch "
                          f"--hidden-layers {flag}`")
    if int(d["hidden"]) != meta["config"]["hidden"]:
        raise ConfigError(f"the head in {folder} was trained for a target of width {meta['config']['hidden']}, this one "
                          f"has {d['hidden']}: train a head for this model")


class HeadModel:
    def __init__(self, folder: str | Path, *, rows: int, capacity: int, vocab: int, threads: int = 2):
        self.root, self.meta = read_head(folder)
        c = self.meta["config"]
        files = self.meta["files"]
        try:
            vm = np.load(self.root / files["vocab_map"]["file"], allow_pickle=False)
        except (ValueError, OSError) as e:
            raise ManifestError(f"{self.root}: vocab_map is not a plain .npy array ({e}); train the head again") from None
        if not isinstance(vm, np.ndarray) or vm.ndim != 1 or len(vm) != c["draft_vocab"] or vm.dtype.kind not in "iu" or \
                (len(vm) and (vm.min() < 0 or vm.max() >= vocab or np.any(np.diff(vm) <= 0))):
            raise ManifestError(f"{self.root}: vocab_map must hold config.draft_vocab increasing token ids below the "
                                f"target's vocabulary ({vocab}); train the head again")
        self.vocab_map = vm.astype(np.int64)
        self.vocab, self.hidden, self.width = vocab, c["hidden"], c["hidden"] * c["n_feats"]
        self._fc = _session(self.root / files["fc"]["file"], threads, {"features": [None, self.width]},
                            {"hidden": [None, self.hidden]})
        kv = [None, c["kv_heads"], None, c["head_dim"]]
        self._head = _session(self.root / files["head"]["file"], threads,
                              {"hidden": [None, None, self.hidden], "input_ids": [None, None], "past_len": [None],
                               "logit_pos": [None, None], "past_k": kv, "past_v": kv},
                              {"logits": [None, None, c["draft_vocab"]], "hidden_out": [None, None, self.hidden],
                               "new_k": kv, "new_v": kv})
        self.rows, self.capacity = rows, capacity
        shape = (rows, c["kv_heads"], capacity, c["head_dim"])
        self.keys, self.values = lazy_zeros(shape, np.float32), lazy_zeros(shape, np.float32)
        self._full = np.full(vocab, -np.inf, np.float32)
        self.acceptance = (self.meta.get("acceptance") or {})

    def move_row(self, src: int, dst: int, length: int) -> None:
        for a in (self.keys, self.values):
            np.copyto(a[dst, :, :length], a[src, :, :length])

    def fc(self, features: np.ndarray) -> np.ndarray:
        return self._fc.run(None, {"features": np.ascontiguousarray(features, np.float32)})[0]

    def step(self, hidden: np.ndarray, tokens: np.ndarray, starts: np.ndarray, positions: np.ndarray):
        n, T = tokens.shape
        if int(starts.max()) + T > self.capacity:
            raise ValueError(f"head step past its cache: start {int(starts.max())} + {T} > {self.capacity}")
        # the cache positions any row may read, rounded up (a row reads only its own [0, start))
        L = min(self.capacity, max(-(-int(starts.max()) // 64) * 64, 64))
        past = [np.ascontiguousarray(a[:n, :, :L]) for a in (self.keys, self.values)]
        logits, out, nk, nv = self._head.run(None, {
            "hidden": np.ascontiguousarray(hidden, np.float32), "input_ids": np.ascontiguousarray(tokens, np.int64),
            "past_len": np.ascontiguousarray(starts, np.int64), "logit_pos": np.ascontiguousarray(positions, np.int64),
            "past_k": past[0], "past_v": past[1]})
        for i in range(n):
            s = int(starts[i])
            self.keys[i, :, s:s + T] = nk[i]
            self.values[i, :, s:s + T] = nv[i]
        return logits[:, 0], out

    def full_logits(self, draft_logits: np.ndarray) -> np.ndarray:
        """Logits over the target's vocabulary: the head's at its draft tokens, -inf elsewhere (a
        reused buffer: read it before the next call)."""
        self._full[self.vocab_map] = draft_logits
        return self._full

    def prior(self) -> float:
        """Its acceptance per drafted token measured on held-out prompts (head.json), for the policy's
        prior: the mean of its per-position rates."""
        alpha = [a for a in (self.acceptance.get("alpha") or []) if isinstance(a, (int, float))]
        return float(min(max(np.mean(alpha), 0.0), 1.0)) if alpha else 0.5


def _session(path: Path, threads: int, inputs: dict, outputs: dict):
    """An ONNX Runtime session of one of the head's graphs, after checking that the graph keeps
    its weights inside its file (no external data: nothing is read from outside the folder) and
    that its inputs and outputs are the ones head.json's config implies."""
    import onnx
    import onnxruntime as ort

    from specrt.runtime.backends.huge_pages import collapsed
    from specrt.runtime.backends.ort_cpu import session_options
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as e:
        raise GraphFileError(f"{path} is not a readable ONNX file ({type(e).__name__}): train the head again") from None
    if any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer):
        raise GraphFileError(f"{path} refers to external weight files; a head's graphs hold their weights: train it "
                             "again with `specrt train-draft`")
    try:
        with collapsed("head graph"):          # its LM head's packed weights on 2 MiB pages (huge_pages.py)
            sess = ort.InferenceSession(str(path), session_options(threads), providers=["CPUExecutionProvider"])
    except Exception as e:
        raise GraphFileError(f"ONNX Runtime could not load {path} ({type(e).__name__}: {str(e)[:300]}): train the "
                             "head again") from None
    for kind, want, have in (("input", inputs, sess.get_inputs()), ("output", outputs, sess.get_outputs())):
        got = {t.name: t.shape for t in have}
        if set(got) != set(want) or any(
                isinstance(g, int) and w is not None and g != w
                for name, dims in want.items() for w, g in zip(dims, got[name])) or \
                any(len(got[name]) != len(dims) for name, dims in want.items()):
            raise GraphFileError(f"{path}: its {kind}s {got} do not match head.json's config (want {want}): train "
                                 "the head again")
    return sess


def open_for_batch(folder, root, man, entry, policy, rows: int, threads: int):
    """(HeadModel, the policy with the head as its draft): the head's step costs from head.json
    (measured by `specrt train-draft` beside the folder's target steps), its prior acceptance
    from the held-out acceptance it recorded."""
    from specrt.runtime.batch.policy import BatchPolicy
    hroot, meta = read_head(folder)
    check_head_for(meta, entry, hroot)
    if policy.costs is None:
        raise ConfigError(f"{root}: its batched model runs plain steps only (no window invariance or no measured "
                          "costs), so a draft head would never run: rebuild it with `specrt build ... --batch`")
    costs = (meta.get("costs_ms") or {}).get("draft")
    if not isinstance(costs, dict) or not costs:
        raise ManifestError(f"{hroot}/head.json has no costs_ms.draft (the head's step time): train it again with "
                            "`specrt train-draft`")
    model = HeadModel(hroot, rows=rows, capacity=man.shapes.kv_capacity, vocab=int(entry.dims["vocab"]),
                      threads=threads)
    costs = policy.costs.with_draft(costs, f"{hroot}/head.json costs_ms.draft")
    return model, BatchPolicy(costs, policy.k_max, lookup=policy.lookup, pair_guess=policy.pair_guess, draft=True,
                              priors={"draft": model.prior()})
