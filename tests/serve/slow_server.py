"""`python slow_server.py ENGINES`: `specrt.serve.serve` on a free port with every token
delayed by 20 ms, so that a stream is surely in flight when the test sends SIGTERM."""
import sys
import time

from specrt.runtime.batch.generator import open_batch
from specrt.runtime.batch.request import Delta
from specrt.serve.server import ServeConfig, serve

from serve_helpers import wrap_sinks


def slow(sink):
    def slowed(ev):
        if isinstance(ev, Delta):
            time.sleep(0.02 * len(ev.tokens))
        sink(ev)
    return slowed


if __name__ == "__main__":
    sys.exit(serve(ServeConfig(sys.argv[1], port=0, timeout=60),
                   factory=lambda engines, **kw: wrap_sinks(open_batch(engines, **kw), slow)))
