"""What a build measures and refuses on, each over the built ONNX graphs (specrt/driver.py):

- `identity.py`: decode vs verify rows (greedy speculation must reproduce plain decoding) and a
  quantized target's agreement with fp32.
- `measure.py`: a draft's top-1 agreement with its target.
- `precision.py`: fp16 graphs against their fp32 export (the GPU builds).
- `plan.py`: each graph's step cost and the predicted speedup of every k (adaptive k).
- `kernels.py`: the kernel table: each CPU matrix kernel family (fp32, int4, int8, int8row) timed at
  the shapes the runtime runs, beside the family each shape runs (manifest `build.kernels`).
- `vocab.py`: the draft's kept vocabulary (`--draft-vocab N`) and its coverage.
- `ngrams.py`: the target's n-gram table of its own greedy text (pair rounds).
- `rows.py`: a one-token graph on the multi-row kernels (plain decoding that rounds as the
  verify pass does).
- `batch.py`, `chunks.py`, `batch_costs.py`: the batched model's export, its invariance gates
  (rows, windows, prompt chunks, prompt rows) and its step costs per rows x tokens.
- `here.py`: a built folder's exactness gates measured again on the machine it serves on
  (`specrt retime`; manifest `device.gated_on`).
- `quiet.py`: whether the machine was free while the costs and the kernel table were timed.
"""
