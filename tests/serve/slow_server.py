"""`python slow_server.py ENGINES`: `specrt.serve.serve` on a free port whose streams stop after
their first two pieces of text until a line arrives on stdin, so that a stream is surely in flight
when the test sends SIGTERM (the test sends the line once it has seen the server stop listening)."""
import sys

from specrt.runtime.batch.generator import open_batch
from specrt.runtime.batch.request import Delta
from specrt.serve.server import ServeConfig, serve

from serve_helpers import wrap_sinks


def held(sink):
    pieces = [0]

    def held_sink(ev):
        if isinstance(ev, Delta) and ev.text:
            if pieces[0] == 2:
                sys.stdin.readline()
            pieces[0] += 1
        sink(ev)
    return held_sink


if __name__ == "__main__":
    sys.exit(serve(ServeConfig(sys.argv[1], port=0, timeout=60),
                   factory=lambda engines, **kw: wrap_sinks(open_batch(engines, **kw), held)))
