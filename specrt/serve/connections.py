"""Connection limits: uvicorn's settings, plus the one it lacks, a request read timeout.

uvicorn's h11 protocol waits for a request's headers as long as the client likes (its
keep-alive timer runs only between requests, and stops at the first byte): a client
that trickles a byte now and then holds a connection forever (slowloris). Here each
request must arrive whole, headers and body, within `read_timeout` seconds of the
connection opening (the first request) or of its own first byte (later ones; between
requests uvicorn's keep-alive timeout applies); otherwise the connection is closed.
"""
from __future__ import annotations

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

_RECEIVING = (h11.IDLE, h11.SEND_BODY)      # the client's side while a request is still arriving


def timed_protocol(read_timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol class with a request read timeout (for uvicorn.Config(http=))."""
    return type("TimedH11Protocol", (_TimedH11Protocol,), {"read_timeout": float(read_timeout)})


class _TimedH11Protocol(H11Protocol):
    read_timeout = 15.0
    _read_timer = None

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state not in _RECEIVING:     # the whole request is in (or the connection ends)
            self._disarm()
        elif self._read_timer is None:                  # a later request began: its clock starts now
            self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self) -> None:
        self._disarm()
        self._read_timer = self.loop.call_later(self.read_timeout, self._timed_out)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _timed_out(self) -> None:
        self._read_timer = None
        if not self.transport.is_closing() and self.conn.their_state in _RECEIVING:
            self.transport.close()
