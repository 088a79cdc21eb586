"""What every engine server shares on its HTTP side: the admin bearer check, the OpenAI-style error and
the routes every engine answers alike.

app.post("/admin/weights", dependencies=[Depends(bearer_guard(token))])
return error_response(400, "prompt must be ...")
add_engine_routes(app, card)   # 400 on a malformed request, GET /health, GET /v1/models
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from engines.protocol import ModelCard, ModelList


def bearer_guard(admin_token: str | None) -> Callable[[Request], None]:
    """A FastAPI dependency: 403 when the server has no admin token, 401 when the request's bearer token
    is missing or wrong (compared in constant time)."""

    def admin(request: Request) -> None:
        if admin_token is None:
            raise HTTPException(403, "admin endpoints are off: start the server with an admin token")
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.encode(), admin_token.encode()):
            raise HTTPException(
                401, "missing or wrong admin bearer token", headers={"WWW-Authenticate": "Bearer"}
            )

    return admin


def error_response(status: int, message: str) -> JSONResponse:
    """An error as the OpenAI API (and vLLM) writes it: {"error": {"message", "type", "code"}}."""
    body = {
        "error": {"message": message, "type": "BadRequestError" if status == 400 else "Error", "code": status}
    }
    return JSONResponse(body, status_code=status)


def add_engine_routes(app: FastAPI, card: Callable[[], ModelCard]) -> None:
    """Adds what every engine server answers alike: a malformed request's 400 (error_response), GET /health,
    and GET /v1/models listing the one model ``card()`` describes (made per request: it may change)."""

    @app.exception_handler(RequestValidationError)
    async def _bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(400, str(exc.errors()[:3]))

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({})

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[card()])
