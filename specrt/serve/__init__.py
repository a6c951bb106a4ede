"""An OpenAI-compatible HTTP server over the decode engine (runtime/batch/; `specrt serve`).

The HTTP layer is a thin adapter; each concern lives in its own small module
(as vLLM's `entrypoints/openai` does):

    errors.py      `RequestError` and its kinds: the HTTP status and OpenAI error fields
    protocol.py    request types (pydantic) and the response/SSE bodies
    validation.py  a parsed request -> `GenerationRequest` (token ids, SamplingParams), or a 400
    pool.py        `EnginePool`: C copies of the engine (open_batch), N rows each, behind one
                   bounded queue; the engine's events reach the async handler through the
                   event loop
    metrics.py     the Prometheus collectors behind /metrics
    app.py         the FastAPI routes (completions, chat, models, health, metrics)
    server.py      `ServeConfig` and `serve()`: uvicorn, SIGTERM drains and exits 0
    triton.py      `specrt triton-repo`: a Triton Python-backend model repository, whose
    triton_model.py  `model.py` (TritonPythonModel) imports the runtime only

Imports the runtime, never the build (no torch, no transformers). Nothing is imported
here, so `specrt triton-repo` works without the `serve` extra (FastAPI, uvicorn):

    from specrt.serve.server import ServeConfig, serve
"""
