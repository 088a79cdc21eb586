"""What every engine server shares on its HTTP side: the admin bearer check and the OpenAI-style error.

app.post("/admin/weights", dependencies=[Depends(bearer_guard(token))])
return error_response(400, "prompt must be ...")
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

from fastapi import HTTPException, Request
from fastapi.responses import JSONResponse


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
