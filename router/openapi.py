"""The OpenAPI description (/openapi.json, /docs) of the routes that parse their own bodies.

/docs is Swagger UI served from the `swagger-ui-bundle` package's files (/docs/static/...), not
a CDN: it works on a host without internet access.

The OpenAI routes read the raw body themselves (size limit, JSON, the parameters not
implemented yet, then the pydantic model: runner.py), so FastAPI cannot see their request
models; this adds them, with the error responses every route can give, to FastAPI's
generated document: schema-driven clients and fuzzers then know what a valid request is
and which statuses to expect.
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel

from .schemas import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest

BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
          "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}
DOCS_STATIC = "/docs/static"
STREAMING = ("/v1/completions", "/v1/chat/completions")
ERRORS = {"400": "invalid request (the error names the parameter)", "401": "missing or wrong API key",
          "403": "an admin route on a server without an admin key", "404": "unknown model or route",
          "408": "request headers not received in time", "413": "request body too large",
          "415": "the body is not JSON (Content-Type: application/json)",
          "429": "server busy (Retry-After)", "503": "no worker to serve it while a replacement starts (Retry-After)"}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


def install(app: FastAPI) -> None:
    def build() -> dict:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
            comps = doc.setdefault("components", {}).setdefault("schemas", {})
            for model in (*BODIES.values(), ErrorResponse):
                js = model.model_json_schema(ref_template="#/components/schemas/{model}")
                comps.update(js.pop("$defs", {}))
                comps[model.__name__] = js
            error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
            for path, ops in doc["paths"].items():
                for op in ops.values():
                    op.setdefault("responses", {}).update(
                        {code: {"description": why, **error} for code, why in ERRORS.items()})
                    op["responses"].pop("422", None)  # FastAPI's own validation error: never sent
                model = BODIES.get(path)
                if path in STREAMING:  # stream: true answers with server-sent events
                    ok = ops["post"]["responses"].setdefault("200", {"description": "Successful Response"})
                    ok.setdefault("content", {})["text/event-stream"] = {"schema": {}}  # chunks: the JSON shapes
                if model is not None:
                    ops["post"]["requestBody"] = {"required": True, "content": {"application/json": {
                        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = build
    from swagger_ui_bundle import swagger_ui_path

    app.mount(DOCS_STATIC, StaticFiles(directory=str(swagger_ui_path)), name="docs-static")

    @app.get("/docs", include_in_schema=False)
    async def docs():
        return get_swagger_ui_html(openapi_url="/openapi.json", title="pdserve: API",
                                   swagger_js_url=f"{DOCS_STATIC}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{DOCS_STATIC}/swagger-ui.css",
                                   swagger_favicon_url=f"{DOCS_STATIC}/favicon-32x32.png")
