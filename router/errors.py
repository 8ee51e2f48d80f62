"""Errors as OpenAI error objects, and the guard every request passes first (API key,
body size), as a pure ASGI middleware so streaming and disconnects pass through."""

from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse

from .schemas import error_body


class HTTPError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.headers = status, message, type_, param, headers


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, status), status_code=status, headers=headers)


class GuardMiddleware:
    """API key (constant-time compare) on every route but OPEN ones (the health check, the
    version and the API's own description), and a body-size limit from Content-Length;
    `on_refuse(status)` counts each refusal."""

    OPEN = ("/health", "/version", "/docs", "/openapi.json")

    def __init__(self, app, api_key: str | None, max_body_bytes: int, on_refuse):
        self.app, self.api_key, self.max_body_bytes, self.on_refuse = app, api_key, max_body_bytes, on_refuse

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode().lower(): v.decode() for k, v in scope.get("headers", [])}
        if self.api_key and scope["path"] not in self.OPEN:
            given = headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                self.on_refuse(401)
                return await error_response(401, "invalid or missing API key (Authorization: Bearer ...)",
                                            "authentication_error")(scope, receive, send)
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            self.on_refuse(413)
            return await error_response(413, f"request body of {length} bytes exceeds the limit of "
                                             f"{self.max_body_bytes}")(scope, receive, send)
        return await self.app(scope, receive, send)
