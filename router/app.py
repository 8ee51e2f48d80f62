"""The OpenAI-compatible HTTP front of a pdserve cluster (FastAPI, served by uvicorn).

    POST /v1/completions, /v1/chat/completions   (stream: SSE, `data: [DONE]`)
    GET  /v1/models, /health, /metrics, /admin/status;  POST /admin/scale

A request is validated (body size, JSON, fields, n, sampling values, prompt +
max_tokens against max_model_len) before anything is queued, so every refusal is an
OpenAI error object with a 4xx status and no stream has started. Placement happens
in the cluster (cluster/routing.py); the response headers x-pdserve-prefill and
x-pdserve-decode name the workers that served it. A client that goes away cancels
the request, which aborts it on every worker and frees its blocks.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError

from pdserve.engine.outputs import RequestOutput

from .metrics import RouterMetrics
from .schemas import ChatCompletionRequest, CompletionRequest, error_body


class HTTPError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.headers = status, message, type_, param, headers


def _error(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
           headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, status), status_code=status, headers=headers)


class _GuardMiddleware:
    """API key (constant-time compare) on every route but /health, and a body-size limit
    from Content-Length; a pure ASGI middleware so streaming and disconnects pass through."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int, metrics: RouterMetrics):
        self.app, self.api_key, self.max_body_bytes, self.metrics = app, api_key, max_body_bytes, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode().lower(): v.decode() for k, v in scope.get("headers", [])}
        if self.api_key and scope["path"] != "/health":
            given = headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
                self.metrics.http_errors.labels("401").inc()
                return await _error(401, "invalid or missing API key (Authorization: Bearer ...)",
                                    "authentication_error")(scope, receive, send)
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            self.metrics.http_errors.labels("413").inc()
            return await _error(413, f"request body of {length} bytes exceeds the limit of {self.max_body_bytes}",
                                )(scope, receive, send)
        return await self.app(scope, receive, send)


class _Done:
    def __init__(self, fut):
        self.fut = fut


def build_app(cluster, api_key: str | None = None, max_body_bytes: int = 1 << 20, max_queue: int = 256,
              served_model_name: str | None = None) -> FastAPI:
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None)
    metrics = RouterMetrics(cluster)
    model_name = served_model_name or os.path.basename(os.path.normpath(cluster.model_path))
    tok = cluster.tokenizer
    state = {"inflight": 0}
    app.state.cluster, app.state.metrics = cluster, metrics

    @app.exception_handler(HTTPError)
    async def _http_error(_request, exc: HTTPError):
        metrics.http_errors.labels(str(exc.status)).inc()
        return _error(exc.status, exc.message, exc.type, exc.param, exc.headers)

    async def parse(request: Request, model_cls):
        body = await request.body()
        if len(body) > max_body_bytes:
            raise HTTPError(413, f"request body of {len(body)} bytes exceeds the limit of {max_body_bytes}")
        try:
            data = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise HTTPError(400, f"malformed JSON body: {e}") from None
        if not isinstance(data, dict):
            raise HTTPError(400, "the JSON body must be an object")
        try:
            return model_cls.model_validate(data)
        except ValidationError as e:
            err = e.errors()[0]
            param = ".".join(str(x) for x in err.get("loc", ()))
            raise HTTPError(400, f"invalid field {param!r}: {err.get('msg')}", param=param or None) from None

    def check_model(req) -> None:
        if req.model not in (None, model_name, cluster.model_path):
            raise HTTPError(404, f"model {req.model!r} does not exist; this server serves {model_name!r}",
                            param="model")

    def sampling(req, ids: list[int], default_max: int | None):
        n = len(ids)
        if n == 0:
            raise HTTPError(400, "prompt is empty", param="prompt")
        if n >= cluster.max_model_len:
            raise HTTPError(400, f"prompt has {n} tokens; max_model_len is {cluster.max_model_len}",
                            param="prompt")
        max_tokens = req.max_tokens if req.max_tokens is not None else default_max
        if max_tokens is None:
            max_tokens = cluster.max_model_len - n
        if n + max_tokens > cluster.max_model_len:
            raise HTTPError(400, f"prompt ({n} tokens) + max_tokens ({max_tokens}) exceeds max_model_len "
                                 f"({cluster.max_model_len})", param="max_tokens")
        try:
            return req.sampling_params(max_tokens)
        except ValueError as e:
            param = "n" if str(e).startswith("n=") else next(
                (f for f in ("temperature", "top_p", "top_k", "max_tokens", "min_tokens", "stop", "seed")
                 if str(e).startswith(f)), None)
            raise HTTPError(400, str(e), param=param) from None

    def admit() -> None:
        """Takes a slot of the bounded queue; outputs() gives it back when the request ends."""
        if state["inflight"] >= max_queue:
            raise HTTPError(429, f"server busy: {state['inflight']} requests in flight (limit {max_queue})",
                            "rate_limit_error", headers={"Retry-After": "1"})
        state["inflight"] += 1

    async def outputs(text, ids, params, request: Request):
        """Yields RequestOutputs as the cluster produces them; cancels the request if the
        consumer stops early (client disconnect)."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        t0 = time.monotonic()
        last = None
        fut = cluster.submit(text, ids, params, lambda out: loop.call_soon_threadsafe(q.put_nowait, out))
        fut.add_done_callback(lambda f: loop.call_soon_threadsafe(q.put_nowait, _Done(f)))
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, _Done):
                    exc = item.fut.exception() if not item.fut.cancelled() else None
                    if isinstance(exc, ValueError):
                        raise HTTPError(400, str(exc))
                    if exc is not None:
                        raise HTTPError(500, f"request failed: {exc}", "server_error")
                    return
                now = time.monotonic()
                if item.outputs and item.outputs[0].token_ids:
                    if last is None:
                        metrics.ttft.observe(now - t0)
                    else:
                        metrics.itl.observe(now - last)
                    last = now
                if item.finished:
                    finished = True
                    metrics.e2e.observe(now - t0)
                    reason = item.outputs[0].finish_reason if item.outputs else "abort"
                    metrics.requests.labels(reason or "abort").inc()
                    metrics.prompt_tokens.inc(len(ids))
                    if item.outputs:
                        metrics.generation_tokens.inc(len(item.outputs[0].token_ids))
                yield item
        finally:
            state["inflight"] -= 1
            if not finished:
                fut.cancel()  # aborts on every worker, frees the blocks

    async def run_to_end(text, ids, params, request: Request) -> RequestOutput:
        """Non-streaming: the final output; cancels if the client disconnects first."""
        final: list = []

        async def consume():
            async for out in outputs(text, ids, params, request):
                if out.finished:
                    final.append(out)

        task = asyncio.ensure_future(consume())
        while not task.done():
            done, _ = await asyncio.wait({task}, timeout=0.5)
            if not done and await request.is_disconnected():
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
                raise HTTPError(499, "client closed the request")
        task.result()
        if not final:
            raise HTTPError(500, "request ended without output", "server_error")
        return final[0]

    def headers_of(out: RequestOutput) -> dict:
        return {"x-pdserve-prefill": out.prefill_worker or "", "x-pdserve-decode": out.decode_worker or ""}

    def usage(n_prompt: int, n_out: int) -> dict:
        return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}

    def check_final(out: RequestOutput) -> None:
        c = out.outputs[0] if out.outputs else None
        if c is None or c.finish_reason == "error":
            raise HTTPError(503 if c is not None else 499, f"request failed: {c.stop_reason if c else 'aborted'}",
                            "server_error")

    async def first_output(gen):
        """Awaits the first output before the response starts (its workers go in the headers,
        and errors before it are still plain HTTP errors)."""
        try:
            return await gen.__anext__()
        except StopAsyncIteration:
            raise HTTPError(500, "request ended without output", "server_error") from None

    def sse(obj) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    def stream_response(gen, first: RequestOutput, rid: str, created: int, obj: str, n_prompt: int, req, render,
                        opening: dict | None = None) -> StreamingResponse:
        """SSE for both endpoints: `render(out, completion)` gives each output's choices."""
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def event(choices: list, **extra) -> str:
            return sse({"id": rid, "object": obj, "created": created, "model": model_name, "choices": choices,
                        **extra})

        async def body():
            out = first
            try:
                if opening is not None:
                    yield event([opening])
                while True:
                    c = out.outputs[0] if out.outputs else None
                    if c is None:  # aborted
                        break
                    if c.finish_reason == "error":
                        yield sse(error_body(f"request failed: {c.stop_reason}", "server_error", None, 503))
                        break
                    for choice in render(out, c):
                        yield event([choice])
                    if out.finished:
                        if include_usage:
                            yield event([], usage=usage(n_prompt, len(c.token_ids)))
                        break
                    out = await gen.__anext__()
                yield "data: [DONE]\n\n"
            finally:
                await gen.aclose()

        return StreamingResponse(body(), media_type="text/event-stream", headers=headers_of(first))

    # ---- /v1/completions ---------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await parse(request, CompletionRequest)
        check_model(req)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise HTTPError(400, f"batched prompts ({len(prompt)}) are not supported: send one per request",
                                param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str):
            text, ids = prompt, (tok.encode(prompt) if prompt else [])
        else:
            text, ids = None, list(prompt)
            if any(not 0 <= t < cluster.engine_config.model_config.vocab_size for t in ids):
                raise HTTPError(400, "prompt token ids out of the vocabulary's range", param="prompt")
        params = sampling(req, ids, 16)
        admit()
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if not req.stream:
            out = await run_to_end(text, ids, params, request)
            check_final(out)
            c = out.outputs[0]
            return JSONResponse({"id": rid, "object": "text_completion", "created": created, "model": model_name,
                                 "choices": [{"index": 0, "text": c.text, "logprobs": None,
                                              "finish_reason": c.finish_reason}],
                                 "usage": usage(len(ids), len(c.token_ids))}, headers=headers_of(out))
        gen = outputs(text, ids, params, request)
        first = await first_output(gen)

        def render(out: RequestOutput, c) -> list[dict]:
            if not (out.delta_text or out.finished):
                return []
            return [{"index": 0, "text": out.delta_text, "logprobs": None,
                     "finish_reason": c.finish_reason if out.finished else None}]

        return stream_response(gen, first, rid, created, "text_completion", len(ids), req, render)

    # ---- /v1/chat/completions ------------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = await parse(request, ChatCompletionRequest)
        check_model(req)
        if req.max_completion_tokens is not None and req.max_tokens is None:
            req.max_tokens = req.max_completion_tokens
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            ids = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                               return_dict=False))
        except Exception as e:  # noqa: BLE001 - the template rejects the conversation
            raise HTTPError(400, f"cannot apply the chat template: {e}", param="messages") from None
        params = sampling(req, ids, None)
        admit()
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if not req.stream:
            out = await run_to_end(None, ids, params, request)
            check_final(out)
            c = out.outputs[0]
            return JSONResponse({"id": rid, "object": "chat.completion", "created": created, "model": model_name,
                                 "choices": [{"index": 0, "message": {"role": "assistant", "content": c.text},
                                              "logprobs": None, "finish_reason": c.finish_reason}],
                                 "usage": usage(len(ids), len(c.token_ids))}, headers=headers_of(out))
        gen = outputs(None, ids, params, request)
        first = await first_output(gen)

        def render(out: RequestOutput, c) -> list[dict]:
            choices = [{"index": 0, "delta": {"content": out.delta_text}, "logprobs": None, "finish_reason": None}
                       ] if out.delta_text else []
            if out.finished:
                choices.append({"index": 0, "delta": {}, "logprobs": None, "finish_reason": c.finish_reason})
            return choices

        opening = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return stream_response(gen, first, rid, created, "chat.completion.chunk", len(ids), req, render, opening)

    # ---- the rest --------------------------------------------------------------------------------
    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "pdserve",
                                            "max_model_len": cluster.max_model_len}]}

    @app.get("/health")
    async def health():
        pools = cluster.pool_sizes()
        ok = pools["decode"] > 0 and (pools["prefill"] > 0 or cluster.mode == "colocated")
        return JSONResponse({"status": "ok" if ok else "degraded", "pools": pools}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prom():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/admin/scale")
    async def scale(request: Request):
        body = await request.body()
        try:
            data = json.loads(body)
        except json.JSONDecodeError as e:
            raise HTTPError(400, f"malformed JSON body: {e}") from None
        if not isinstance(data, dict) or not set(data) <= {"prefill", "decode"} or not data:
            raise HTTPError(400, 'body must be {"prefill": n, "decode": m} (either or both)')
        for k, v in data.items():
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise HTTPError(400, f"{k} must be an integer >= 1, got {v!r}", param=k)
        try:
            sizes = await asyncio.get_running_loop().run_in_executor(None, lambda: cluster.scale(**data))
        except ValueError as e:  # e.g. outside the autoscaler's bounds
            raise HTTPError(400, str(e)) from None
        return {"pools": sizes}

    @app.get("/admin/status")
    async def status():
        rows = await asyncio.get_running_loop().run_in_executor(None, cluster.status)
        return {"pools": cluster.pool_sizes(), "workers": rows, "routing": cluster.counters["routing"],
                "autoscale": {"enabled": cluster.serving.autoscale.enabled,
                              "events": cluster.counters["autoscale"][-20:]}}

    app.add_middleware(_GuardMiddleware, api_key=api_key, max_body_bytes=max_body_bytes, metrics=metrics)
    return app
