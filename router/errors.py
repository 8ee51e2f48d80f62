"""Errors as OpenAI error objects, and the guard every request passes first (API key,
body size), as a pure ASGI middleware so streaming and disconnects pass through."""

from __future__ import annotations

import hmac

from fastapi.responses import JSONResponse

from .schemas import error_body


class HTTPError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 headers: dict | None = None, admission: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.headers = status, message, type_, param, headers
        self.admission = admission  # why the request was not admitted (queue_full, no_worker): metrics


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, status), status_code=status, headers=headers)


def route_path(scope) -> str:
    """The path the routes match: below the root path (--root-path, behind a proxy) when the
    request carries it, as Starlette's router reads it (the guard must see what the router sees)."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root) and (len(path) == len(root) or path[len(root)] == "/"):
        return path[len(root):] or "/"
    return path


class GuardMiddleware:
    """Every request passes here first.

    keys     the inference key (`api_key`) on every route but OPEN ones (the health check,
             the version and the API's own description); the admin key (`admin_key`) on
             /admin/*, which the inference key never opens: with an inference key and no admin
             key the admin routes are refused (403) rather than left to inference clients.
             Keys are compared in constant time.
    headers  decoded as latin-1 (what HTTP allows on the wire): a byte outside ASCII is a
             wrong key, never a 500
    size     a body over `max_body_bytes` is a 413: from Content-Length at once, and counted as
             it arrives otherwise (a chunked body is never read whole first)
    `on_refuse(status)` counts each refusal."""

    OPEN = ("/health", "/version", "/docs", "/openapi.json")
    OPEN_UNDER = "/docs/static/"  # Swagger UI's own files

    def __init__(self, app, api_key: str | None, max_body_bytes: int, on_refuse, admin_key: str | None = None,
                 root_path: str = ""):
        self.app, self.api_key, self.admin_key = app, api_key, admin_key
        self.max_body_bytes, self.on_refuse, self.root_path = max_body_bytes, on_refuse, root_path

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.root_path:  # --root-path: the routes match below it, with or without it in the path
            scope = {**scope, "root_path": self.root_path}
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        refusal = self._refusal(route_path(scope), headers)
        if refusal is not None:
            self.on_refuse(refusal[0])
            return await error_response(*refusal)(scope, receive, send)
        return await self.app(scope, self._bounded(receive), send)

    def _refusal(self, path: str, headers: dict) -> tuple | None:
        given = headers.get("authorization", "").encode("latin-1")
        if path.startswith("/admin/") or path == "/admin":
            if self.admin_key:
                if not hmac.compare_digest(given, f"Bearer {self.admin_key}".encode()):
                    return 401, "invalid or missing admin key (Authorization: Bearer ...)", "authentication_error"
            elif self.api_key:
                return (403, "the admin routes need their own key: start the server with --admin-key "
                             "(or PDSERVE_ADMIN_KEY)", "permission_error")
        elif self.api_key and path not in self.OPEN and not path.startswith(self.OPEN_UNDER):
            if not hmac.compare_digest(given, f"Bearer {self.api_key}".encode()):
                return 401, "invalid or missing API key (Authorization: Bearer ...)", "authentication_error"
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return 413, f"request body of {length} bytes exceeds the limit of {self.max_body_bytes}"
        return None

    def _bounded(self, receive):
        """`receive`, refusing (413) once the body passes the limit, whatever its framing."""
        seen = 0

        async def bounded():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_body_bytes:
                    raise HTTPError(413, f"request body of more than {self.max_body_bytes} bytes exceeds the limit")
            return message
        return bounded


RETRY_FAILED_S = 1  # Retry-After of a request whose tries all failed: the next try meets the pools as they are then


def failure(out) -> HTTPError | None:
    """The HTTP error an output stands for: aborted (499), a worker failure ("error": 503 with
    Retry-After: a client told to retry gets a fresh placement, or a 503 saying how long), or
    the request's own parameters ("invalid": 400 naming the parameter, e.g. a grammar whose
    next character the tokenizer cannot spell); None for an output that did not fail."""
    c = out.outputs[0] if out.outputs else None
    if c is None:
        return HTTPError(499, "request failed: aborted", "server_error")
    if c.finish_reason == "error":  # its tries failed (workers lost): it may be sent again shortly
        return HTTPError(503, f"request failed: {c.stop_reason}", "server_error",
                         headers={"Retry-After": str(RETRY_FAILED_S)})
    if c.finish_reason == "invalid":
        name = str(c.stop_reason).split(":", 1)[0]
        return HTTPError(400, str(c.stop_reason), param="response_format" if name == "structured_outputs" else name)
    return None


def check_final(out) -> None:
    """A final output that failed is an HTTP error (nothing has been sent yet)."""
    err = failure(out)
    if err is not None:
        raise err
