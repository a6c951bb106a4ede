"""`specrt build` and `specrt qdq`: from a model source (or an fp32 engine folder) to an engine
folder described by its manifest. The runtime never imports this package.

    config.py           BuildConfig (frozen), PRESETS, BACKEND_SPECS, config_for (presets -> folders)
    pipeline.py         build(cfg): resolve the backend, check --out, build into a hidden partial
                        folder, swap it into place (outdir.py)
    backend.py          --backend auto -> a backend (probe + select_backend); GPU refusals up front
    cpu.py              the ONNX Runtime CPU build: export -> parity -> quantize -> gates -> manifest
    gpu.py              the ort-cuda / tensorrt builds: fp16 exports, fp16-vs-fp32 gate, engines
    steps.py            what both builds share (window, tokenizer, prompts, kv record, truncation)
    gates/              the checks and measurements a build records or refuses on
    manifest_writer.py  parts -> manifest.json (every backend's)
    qdq_engine.py       `specrt qdq`: an fp32 folder's target as static INT8 Q/DQ, as a folder
    outdir.py           --out: never delete what specrt did not create

Imports point one way: cli -> build -> (export, calibration, engines, driver) -> manifest,
errors, runtime. Nothing here is imported at package import time, so `specrt qdq` (ONNX in,
ONNX out) never loads torch.
"""
