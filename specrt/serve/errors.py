"""Errors the server answers with an OpenAI-style body: `{"error": {message, type, param, code}}`."""
from __future__ import annotations

from specrt.errors import SpecrtError


class RequestError(SpecrtError):
    """A request the server refuses. Carries the HTTP status and the OpenAI error fields;
    the message says what to change."""

    status = 400
    type = "invalid_request_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 status: int | None = None, type: str | None = None):
        super().__init__(message)
        self.param, self.code = param, code
        if status is not None:
            self.status = status
        if type is not None:
            self.type = type


class ModelNotFoundError(RequestError):
    status, type = 404, "invalid_request_error"


class QueueFullError(RequestError):
    """Every worker is busy and the waiting queue is full: retry later (429)."""
    status, type = 429, "rate_limit_error"


class ServerShuttingDownError(RequestError):
    status, type = 503, "server_error"


class ServeConfigError(SpecrtError):
    """`specrt serve` was started with settings it cannot run with."""
