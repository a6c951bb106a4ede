"""The FastAPI routes: a thin adapter from HTTP to `EnginePool` jobs (pool.py), whose events
are the engine's own (Delta, Done, Failed of runtime/batch/request.py).

    POST /v1/completions, /v1/chat/completions   stream (SSE, ends with `data: [DONE]`) or not
    GET  /v1/models, /health, /metrics

Every refusal is an OpenAI-style body `{"error": {message, type, param, code}}`:
400 bad request, 404 unknown model, 429 queue full, 503 shutting down, 504 timeout
(and, from guard.py in front of the app, 400 unknown Host, 401 no API key, 413 body too large).
A streaming client that goes away cancels its job (Starlette cancels the response
task; the `finally` below cancels the job); a non-streaming one is checked for every
DISCONNECT_POLL_S, whether tokens are flowing or not.
Validation (tokenizing the prompt, rendering the chat template) runs in a thread, off
the event loop, so a long prompt never stalls the other requests' streams or /health.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from specrt.serve import protocol as p
from specrt.serve.errors import RequestError
from specrt.serve.metrics import CONTENT_TYPE, ServerMetrics
from specrt.serve.validation import GenerationRequest, Validator
from specrt.runtime.batch.request import Delta, Done, Failed
from specrt.serve.pool import FINISH_REASONS, EnginePool, Job, done_metrics, rss_mib

log = logging.getLogger("specrt.serve")
DISCONNECT_POLL_S = 0.25        # how often a non-streaming request checks that its client is still there


class _Timeout(Exception):
    pass


class _Reader:
    """Reads a job's events in order, enforcing the request deadline and observing
    time to first token and inter-token latency."""

    def __init__(self, job: Job, timeout: float, metrics: ServerMetrics):
        self.job, self.deadline, self.metrics = job, job.t_arrival + timeout, metrics
        self.last_t: float | None = None

    async def next(self, poll: float | None = None):
        """The next (sample index, event); (0, None) when `poll` seconds pass first; _Timeout past
        the deadline."""
        left = self.deadline - time.perf_counter()
        if left <= 0:
            raise _Timeout
        try:
            index, ev, t = await asyncio.wait_for(self.job.events.get(), min(left, poll or left))
        except asyncio.TimeoutError:
            if poll and left > poll:
                return 0, None
            raise _Timeout from None
        if isinstance(ev, Delta) and ev.tokens:
            if self.last_t is None:
                self.metrics.ttft.observe(t - self.job.t_arrival)
            else:
                self.metrics.itl.observe(t - self.last_t)
            for _ in ev.tokens[1:]:     # a round's other tokens arrive with its first: no gap
                self.metrics.itl.observe(0.0)
            self.last_t = t
        elif isinstance(ev, Done):
            self.metrics.e2e.observe(time.perf_counter() - self.job.t_arrival)
        return index, ev


def _outcome(status: int) -> str:
    return "rejected" if status in (429, 503) else "bad_request" if status < 500 else "error"


class _JobResponse(StreamingResponse):
    """Cancels its job however the response ends, even if the body was never iterated."""

    def __init__(self, pool: EnginePool, job: Job, content, **kw):
        super().__init__(content, **kw)
        self.pool, self.job = pool, job

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.pool.cancel(self.job)


def create_app(pool: EnginePool, validator: Validator, metrics: ServerMetrics, *, model_name: str,
               timeout: float, max_context: int) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        if not pool.info:
            await asyncio.to_thread(pool.start)
        yield
        await asyncio.to_thread(pool.close)     # uvicorn has drained the HTTP requests by now

    app = FastAPI(title="specrt", lifespan=lifespan, docs_url=None, redoc_url=None)
    metrics.watch(lambda: pool.queued, lambda: pool.busy)
    timeout_msg = (f"the request did not finish within the server's timeout of {timeout:g} s: ask for fewer "
                   "max_tokens, retry when the server is less busy, or raise --timeout")

    def error(status: int, message: str, type: str, param=None, code=None) -> JSONResponse:
        return JSONResponse(p.error_body(message, type, param, code), status_code=status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        metrics.count(request.url.path, "bad_request")
        errs = exc.errors()
        first = errs[0] if errs else {"loc": (), "msg": "invalid request", "type": ""}
        loc = [str(x) for x in first["loc"] if x != "body"]
        param = loc[0] if loc else None
        msgs = list(dict.fromkeys(e["msg"] for e in errs if [str(x) for x in e["loc"] if x != "body"][:1] == loc[:1]))
        what = ".".join(loc[:2]) if len(loc) > 1 and loc[1].isdigit() else param or "body"
        got = "" if first.get("type") == "missing" else f" (got {repr(first.get('input'))[:80]})"
        return error(400, f"invalid '{what}': {'; or '.join(msgs)}{got}", "invalid_request_error", param,
                     "invalid_value")

    @app.exception_handler(RequestError)
    async def refused(request: Request, exc: RequestError):
        metrics.count(request.url.path, _outcome(exc.status))
        return error(exc.status, str(exc), exc.type, exc.param, exc.code)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception):
        log.error("unexpected error on %s", request.url.path, exc_info=exc)
        metrics.count(request.url.path, "error")
        return error(500, f"internal error ({type(exc).__name__}); the server log has the details",
                     "server_error")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", "invalid_request_error")

    async def parsed(request: Request, model: type[BaseModel]):
        """The body as `model`; every body that is not one JSON object is the same 400 (invalid_json),
        which FastAPI's own parsing does not give (bad UTF-8, a 5000-digit integer: a bare 400)."""
        try:
            return model.model_validate(p.parse_json(await request.body()))
        except ValidationError as e:
            raise RequestValidationError(e.errors(include_url=False)) from None

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await parsed(request, p.CompletionRequest)
        return await generate(request, await asyncio.to_thread(validator.completion, body))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await parsed(request, p.ChatCompletionRequest)
        return await generate(request, await asyncio.to_thread(validator.chat, body))

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": int(started),
                                            "owned_by": "specrt", "max_model_len": max_context}]}

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": model_name, "method": pool.method, "queued": pool.queued,
                "busy": pool.busy, "queue_size": pool.queue_size, "rss_mib": round(rss_mib(), 1),
                "workers": [vars(w) for w in pool.info]}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.exposition(), media_type=CONTENT_TYPE)

    started = time.time()

    async def generate(request: Request, req: GenerationRequest):
        job = Job(req, asyncio.get_running_loop())
        pool.submit(job)                         # QueueFullError -> 429
        chat = req.kind == "chat"
        rid, created = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, int(time.time())
        reader = _Reader(job, timeout, metrics)
        # one formatter per sample (a completion's text_offset runs on across its own chunks)
        fmt = [p.LogprobFormat(token_text, chat, validator.grammars.token_bytes) for _ in range(req.n)] \
            if req.logprobs is not None else None     # (logprobs are refused where grammars is None)
        if req.stream:
            return _JobResponse(pool, job, stream(request.url.path, job, reader, rid, created, chat, fmt),
                                media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await complete(request, job, reader, rid, created, chat, fmt)

    def token_text(token: int) -> str:
        return validator.tok.decode([token], skip_special_tokens=False)

    async def stream(endpoint: str, job: Job, reader: _Reader, rid: str, created: int, chat: bool, fmt=None):
        def chunk(text: str | None, finish: str | None, lps=None, index: int = 0) -> bytes:
            lp = fmt[index](lps) if fmt is not None and lps is not None else None
            if chat:
                return p.sse(p.chat_chunk(rid, created, model_name, {} if text is None else {"content": text}, finish,
                                          logprobs=lp, index=index))
            return p.sse(p.completion_body(rid, created, model_name, text or "", finish, logprobs=lp, index=index))

        outcome, n, finished, completion_tokens = "cancelled", job.request.n, 0, 0
        try:
            if chat:
                for i in range(n):
                    yield p.sse(p.chat_chunk(rid, created, model_name, {"role": "assistant", "content": ""}, None,
                                             index=i))
            while True:
                try:
                    index, ev = await reader.next()
                except _Timeout:
                    outcome = "timeout"
                    yield p.sse(p.error_body(timeout_msg, "timeout", None, "timeout"))
                    yield p.SSE_DONE
                    return
                if isinstance(ev, Delta):
                    if ev.text or (fmt is not None and ev.logprobs):
                        yield chunk(ev.text, None, ev.logprobs, index)
                elif isinstance(ev, Failed):
                    e = ev.error
                    outcome = _outcome(e.status)
                    yield p.sse(p.error_body(str(e), e.type, e.param, e.code))
                    yield p.SSE_DONE
                    return
                else:
                    yield chunk(None, FINISH_REASONS.get(ev.finish_reason, "stop"), index=index)
                    finished, completion_tokens = finished + 1, completion_tokens + ev.completion_tokens
                    if finished < n:
                        continue
                    outcome = "ok"
                    if job.request.include_usage:
                        use = p.usage(ev.prompt_tokens, completion_tokens)
                        yield p.sse(p.chat_chunk(rid, created, model_name, {}, None, use) if chat else
                                    p.completion_body(rid, created, model_name, "", None, use) | {"choices": []})
                    yield p.SSE_DONE
                    return
        finally:
            pool.cancel(job)
            metrics.count(endpoint, outcome)

    async def complete(request: Request, job: Job, reader: _Reader, rid: str, created: int, chat: bool, fmt=None):
        n = job.request.n
        endpoint, parts, outcome, lps = request.url.path, [[] for _ in range(n)], "cancelled", [[] for _ in range(n)]
        done: dict[int, Done] = {}     # by sample index
        next_check = time.perf_counter() + DISCONNECT_POLL_S
        try:
            while True:
                try:
                    index, ev = await reader.next(poll=DISCONNECT_POLL_S)
                except _Timeout:
                    outcome = "timeout"
                    return error(504, timeout_msg, "timeout", None, "timeout")
                if time.perf_counter() >= next_check:     # on a timer: tokens may never pause
                    next_check = time.perf_counter() + DISCONNECT_POLL_S
                    if await request.is_disconnected():
                        return Response(status_code=499)    # nobody reads it
                if ev is None:
                    continue
                if isinstance(ev, Delta):
                    parts[index].append(ev.text)
                    lps[index] += ev.logprobs or ()
                elif isinstance(ev, Failed):
                    e = ev.error
                    outcome = _outcome(e.status)
                    return error(e.status, str(e), e.type, e.param, e.code)
                else:
                    done[index] = ev
                    if len(done) < n:
                        continue
                    outcome = "ok"
                    use = p.usage(ev.prompt_tokens, sum(d.completion_tokens for d in done.values()))
                    bodies = [(p.chat_body if chat else p.completion_body)(
                        rid, created, model_name, "".join(parts[i]), FINISH_REASONS.get(done[i].finish_reason, "stop"),
                        use, done_metrics(done[0], pool.method),
                        logprobs=fmt[i](lps[i]) if fmt is not None else None) for i in range(n)]
                    body = bodies[0]
                    body["choices"] = [b["choices"][0] | {"index": i} for i, b in enumerate(bodies)]
                    return JSONResponse(body)
        finally:
            pool.cancel(job)
            metrics.count(endpoint, outcome)

    return app
