"""Trained draft heads (issue 29): an EAGLE-style head that reads the target's own hidden states,
trained on the target's own answers (`specrt train-draft`).

    data.py     prompts, the engine folder's answers, the teacher's features and distributions
    model.py    EagleHead (EAGLE-3's shape, training-time test) and MedusaHead (to compare)
    train.py    the draft vocabulary, training, greedy chain acceptance on held-out answers
    export.py   head_fc.onnx + head.onnx, the batched engine's KV contract
    recipe.py   the stages end to end, resumable; head.json
    cli.py      `specrt train-draft`

Needs torch (training, export); the runtime never imports this package.
"""
