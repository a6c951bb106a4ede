"""Tools over built engine folders. Each imports the runtime (never the other way round) and
reads a folder through its manifest; none imports torch unless asked to compare with
transformers (`bench --hf-reference`).

- `bench.py`: `specrt bench`, plain vs speculative (and lookup) interleaved in one run.
- `quality.py`: `specrt quality`, every folder against the fp32 reference on held-out prompts.
- `op_profile.py`: `specrt profile`, ONNX Runtime's per-operator profile of one generation.
- `describe.py`: `specrt inspect`, a manifest, readable.
"""
