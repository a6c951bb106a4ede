"""`ServeConfig` and `serve()`: load the workers, then run uvicorn until SIGTERM or Ctrl-C.

Shutdown: uvicorn stops listening, lets in-flight requests finish (streams included)
for up to `timeout + DRAIN_MARGIN_S` seconds, cancels what is left, then the app's
lifespan closes the pool (worker threads joined). SIGTERM then exits 0.
"""
from __future__ import annotations

import signal
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from specrt import manifest as mf
from specrt.runtime import MEMORY_MODES
from specrt.runtime.grammar import grammars_for
from specrt.runtime.tokenizer import Tokenizer
from specrt.serve.errors import ServeConfigError
from specrt.serve.metrics import ServerMetrics
from specrt.serve.validation import Validator
from specrt.serve.pool import EnginePool, rss_mib

DRAIN_MARGIN_S = 5.0


@dataclass(frozen=True)
class ServeConfig:
    engines: str
    host: str = "127.0.0.1"
    port: int = 8000                # 0: any free port (printed at start)
    workers: int = 1                # copies of the engine, each with its own weights (memory: docs/serving.md)
    # rows of each copy: up to N requests decoding at once on one copy of the weights (engines
    # built with --batch); None: 1
    max_num_seqs: int | None = None
    queue_size: int = 8             # requests that may wait for a worker before 429
    prefill_budget: int | None = None   # prompt tokens an engine step may prefill (None: one chunk)
    head: str | None = None         # a `specrt train-draft` folder: the draft inside every batch
    timeout: float = 300.0          # seconds from arrival to the last token
    memory: str = "fast"            # "fast" | "shared", passed to every worker's generator
    threads: int = 2                # ORT intra-op threads (one pool for the process)
    model_name: str | None = None   # default: the engine folder's name
    log_level: str = "warning"
    # --- who may call, and how much (guard.py, connections.py) ---
    api_key: str | None = field(default=None, repr=False)   # required as `Authorization: Bearer KEY`
    allowed_hosts: tuple[str, ...] = ()     # Host names accepted besides the defaults; "*": any
    cors_origins: tuple[str, ...] = ()      # browser origins allowed to call (none: no CORS headers)
    max_body_bytes: int = 1 << 20           # larger request bodies get 413
    read_timeout: float = 15.0              # seconds for a request (headers and body) to arrive
    keep_alive: int = 5                     # seconds an idle keep-alive connection stays open
    max_connections: int = 64               # connections (and requests) at once; more get 503

    def __post_init__(self):
        if self.workers < 1:
            raise ServeConfigError(f"--workers {self.workers}: give at least 1")
        if self.max_num_seqs is not None:
            if not 1 <= self.max_num_seqs <= 256:
                raise ServeConfigError(f"--max-num-seqs {self.max_num_seqs}: give a number of rows in [1, 256]")
        if self.prefill_budget is not None and not (isinstance(self.prefill_budget, int)
                                                    and not isinstance(self.prefill_budget, bool)
                                                    and self.prefill_budget >= 1):
            raise ServeConfigError(f"--prefill-budget {self.prefill_budget}: give a positive number of prompt tokens")
        if self.queue_size < 0:
            raise ServeConfigError(f"--queue-size {self.queue_size}: give 0 (no waiting) or more")
        if not self.timeout > 0:
            raise ServeConfigError(f"--timeout {self.timeout}: give a positive number of seconds")
        if self.memory not in MEMORY_MODES:
            raise ServeConfigError(f"--memory {self.memory}: choose one of {', '.join(MEMORY_MODES)}")
        if not 0 <= self.port <= 65535:
            raise ServeConfigError(f"--port {self.port}: give a port in [0, 65535]")
        if self.api_key is not None and not self.api_key.strip():
            raise ServeConfigError("--api-key (or SPECRT_API_KEY) is empty: give a key, or leave it unset for a "
                                   "server without one")
        for name, v in (("--max-body-bytes", self.max_body_bytes), ("--read-timeout", self.read_timeout),
                        ("--keep-alive", self.keep_alive), ("--max-connections", self.max_connections)):
            if not v > 0:
                raise ServeConfigError(f"{name} {v}: give a positive number")

    @property
    def served_name(self) -> str:
        return self.model_name or Path(self.engines).resolve().name


def build_app(cfg: ServeConfig, factory: Callable | None = None):
    """The app and its (not yet started) pool: `workers` copies of the engine with `max_num_seqs`
    rows each. `factory(engines, max_num_seqs=, threads=, memory=)` opens one copy (default
    `open_batch`); tests wrap it."""
    from specrt.runtime.batch.generator import open_batch
    from specrt.serve.app import create_app
    man = mf.load(cfg.engines)
    name = cfg.served_name
    metrics = ServerMetrics(name)
    rows = cfg.max_num_seqs or 1
    if rows > 1 and man.batch is None:
        raise ServeConfigError(f"--max-num-seqs {rows}: {cfg.engines} has no batched model; rebuild it with `specrt "
                               "build ... --batch`, or serve it with --workers N (one request per engine copy)")
    pool = EnginePool(cfg.engines, copies=cfg.workers, max_num_seqs=rows, queue_size=cfg.queue_size,
                      threads=cfg.threads, memory=cfg.memory, factory=factory or open_batch,
                      on_generation=metrics.record_generation, prefill_budget=cfg.prefill_budget, head=cfg.head)
    metrics.watch_batch(lambda: pool.stats)
    tok = Tokenizer(Path(cfg.engines), man.tokenizer)
    # structured outputs and logprobs run on the engine whatever the folder's model (runtime/batch/engine.py)
    vocab = int((man.batch or man.target).dims["vocab"])
    grammars = grammars_for((Path(cfg.engines) / man.tokenizer["file"]).read_text(encoding="utf-8"),
                            tuple(sorted(tok.eos_token_ids)), vocab)
    validator = Validator(tok, max_context=man.shapes.max_context, vocab=int(man.target.dims["vocab"]),
                          model_name=name, grammars=grammars, max_n=rows)
    app = create_app(pool, validator, metrics, model_name=name, timeout=cfg.timeout,
                     max_context=man.shapes.max_context)
    return guarded(app, cfg), pool


def guarded(app, cfg: ServeConfig):
    """The app behind the request guards (outermost first: Host, CORS, API key, body size)."""
    from starlette.middleware.cors import CORSMiddleware

    from specrt.serve.guard import AllowedHosts, ApiKey, BodyLimit, default_hosts
    app = BodyLimit(app, cfg.max_body_bytes)
    if cfg.api_key:
        app = ApiKey(app, cfg.api_key)
    if cfg.cors_origins:
        app = CORSMiddleware(app, allow_origins=list(cfg.cors_origins), allow_methods=["GET", "POST"],
                             allow_headers=["Authorization", "Content-Type"], max_age=600)
    hint = f"http://{'127.0.0.1' if cfg.host in ('0.0.0.0', '::') else cfg.host}:PORT"
    return AllowedHosts(app, hosts=default_hosts(cfg.host) + tuple(cfg.allowed_hosts),
                        any_ip=cfg.host in ("0.0.0.0", "::"), hint=hint)


def uvicorn_config(app, cfg: ServeConfig):
    """uvicorn's settings for `app` under `cfg`'s limits (the tests' live servers use it too)."""
    import uvicorn

    from specrt.serve.connections import timed_protocol
    return uvicorn.Config(app, log_level=cfg.log_level, lifespan="on", http=timed_protocol(cfg.read_timeout),
                          timeout_keep_alive=cfg.keep_alive, limit_concurrency=cfg.max_connections,
                          h11_max_incomplete_event_size=64 * 1024,    # request line + headers
                          timeout_graceful_shutdown=int(cfg.timeout + DRAIN_MARGIN_S))


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ServeConfigError(f"cannot listen on {host}:{port} ({e.strerror}): pick another --port, "
                               "or stop the process that holds it") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve(cfg: ServeConfig, out=print, factory: Callable | None = None) -> int:
    import uvicorn
    app, pool = build_app(cfg, factory)
    sock = bind(cfg.host, cfg.port)     # first: a busy port fails in a second, not after loading
    try:
        pool.start()    # before serving: a bad engine folder is a typed error, not a traceback
    except BaseException:
        sock.close()
        raise
    host, port = sock.getsockname()[:2]
    per = ", ".join(f"{w.load_mib:.0f}" for w in pool.info)
    engines = (f"{cfg.workers} engine cop{'y' if cfg.workers == 1 else 'ies'} x {pool.max_num_seqs} row(s), "
               f"memory {cfg.memory}: +{per} MiB")
    out(f"specrt: serving {cfg.served_name!r} ({pool.method}) on http://{host}:{port}/v1 | {engines}, RSS "
        f"{rss_mib():.0f} MiB | queue {cfg.queue_size} | timeout {cfg.timeout:g} s | API key "
        f"{'required' if cfg.api_key else 'none'}")
    sys.stdout.flush()
    server = uvicorn.Server(uvicorn_config(app, cfg))
    # uvicorn re-raises SIGTERM after its graceful shutdown; with this handler in place
    # that re-raise is a no-op and the process exits 0 once the work is drained
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run(sockets=[sock])
    finally:
        signal.signal(signal.SIGTERM, previous)
        sock.close()
    out("specrt: stopped (in-flight requests drained)")
    return 0
