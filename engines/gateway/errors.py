"""Errors the gateway answers with, in OpenAI's shape, so harnesses (and the `openai` client's
exception classes) read them as they read OpenAI's own:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "messages", "code": "..."}}

The status decides the `openai` exception: 400 BadRequestError, 401 AuthenticationError, 403
PermissionDeniedError, 404 NotFoundError, 413 APIStatusError, >= 500 InternalServerError (retried by
the client). Engines' own failures become EngineDown (connection lost: the call moves to another
engine) or EngineRejected (the engine refused the request: its status and message go to the client).
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    500: "server_error",
    502: "server_error",
    503: "server_error",
    504: "server_error",
}


class GatewayError(Exception):
    """A request the gateway answers with ``status`` and an OpenAI-style body."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        return error_body(self.status, self.message, param=self.param, code=self.code)

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None) -> dict:
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class EngineDown(Exception):
    """The engine could not be reached or dropped the connection: its KV is gone for the gateway."""

    def __init__(self, engine_id: str, reason: str):
        super().__init__(f"engine {engine_id} is unreachable: {reason}")
        self.engine_id = engine_id


class EngineRejected(Exception):
    """The engine answered with an error status (a prompt too long for it, a bad token id...)."""

    def __init__(self, engine_id: str, status: int, message: str):
        super().__init__(f"engine {engine_id} answered {status}: {message}")
        self.engine_id = engine_id
        self.status = status
        self.message = message
