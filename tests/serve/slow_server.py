"""`python slow_server.py ENGINES`: `specrt.serve.serve` on a free port with every token
delayed by 20 ms, so that a stream is surely in flight when the test sends SIGTERM."""
import sys
import time

from specrt.serve.server import ServeConfig, serve
from specrt.serve.workers import load_generator


class Slow:
    def __init__(self, gen):
        self._gen = gen

    def __getattr__(self, name):
        return getattr(self._gen, name)

    def stream(self, *a, **kw):
        inner = self._gen.stream(*a, **kw)
        try:
            for chunk in inner:
                time.sleep(0.02)
                yield chunk
        finally:
            inner.close()


if __name__ == "__main__":
    sys.exit(serve(ServeConfig(sys.argv[1], port=0, timeout=60),
                   factory=lambda engines, **kw: Slow(load_generator(engines, **kw))))
