"""The OpenAI-compatible HTTP front of a pdserve cluster (FastAPI, served by uvicorn).

    POST /v1/completions, /v1/chat/completions   (stream: SSE, `data: [DONE]`)
    POST /tokenize, /detokenize (vLLM's);  GET /version, /docs (OpenAPI)
    GET  /v1/models, /v1/models/{id}, /health, /metrics, /admin/status, /admin/slo, /admin/timeline, /tokenizer_info
    POST /admin/scale, /admin/slo

A request is validated (body size, JSON, fields, n, sampling values, prompt +
max_tokens against max_model_len) before anything is queued, so every refusal is an
OpenAI error object with a 4xx status and no stream has started (runner.py). Placement
happens in the cluster; the response headers x-pdserve-prefill and x-pdserve-decode
name the workers that served it. A client that goes away cancels the request, which
aborts it on every worker and frees its blocks. The app uses the cluster only through
`ServingCluster` (cluster/api.py).
"""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from pdserve import __version__
from pdserve.cluster.api import ServingCluster
from pdserve.engine.default_model import model_name as served_name
from pdserve.engine.validation import ValidRequest

from .chat import chat_ids, special_tokens
from .errors import GuardMiddleware, HTTPError, check_final, error_response, failure
from .metrics import RouterMetrics
from .openapi import install as install_openapi
from .options import ServerOptions
from .render import Renderer, headers_of, json_bytes, sse, usage
from .runner import RequestRunner, check_work, client_of, decode_json, first_copies, sequences
from .schemas import ChatCompletionRequest, CompletionRequest, error_body
from .tokens import add_token_routes, check_model_name
from .tool_parsers import PARSERS
from .tools import ToolCalls


def build_app(cluster: ServingCluster, api_key: str | None = None, max_body_bytes: int = 1 << 20,
              max_queue: int = 256, served_model_name: str | None = None, admin_key: str | None = None,
              chat_special_tokens: str = "refuse", tool_call_parser: str | None = None, root_path: str = "",
              options: ServerOptions | None = None, max_queue_per_client: int | None = None) -> FastAPI:
    """`api_key` guards the inference routes, `admin_key` the /admin routes (errors.py).
    `chat_special_tokens`: "refuse" (400) a chat message whose text spells one of the
    tokenizer's special tokens (it would be read as a control token: a forged turn), or
    "allow" it (vLLM's default). `tool_call_parser`: the model's call format, which serves
    tool_choice "auto" (tool_parsers.py; vLLM's --tool-call-parser). `root_path`: the prefix a
    proxy serves the app under (--root-path): routes answer with it and without it (a proxy that
    strips it). `options`: the server-wide defaults of vLLM's flags (options.py)."""
    options = options or ServerOptions()
    if chat_special_tokens not in ("refuse", "allow"):
        raise ValueError(f"chat_special_tokens must be refuse or allow, got {chat_special_tokens!r}")
    if tool_call_parser is not None and tool_call_parser not in PARSERS:
        raise ValueError(f"tool_call_parser must be one of {sorted(PARSERS)}, got {tool_call_parser!r}")
    app = FastAPI(title="pdserve", version=__version__, docs_url=None, redoc_url=None)  # /docs: openapi.py
    model_name = served_model_name or served_name(cluster.model_path)
    metrics = RouterMetrics(cluster, model_name)
    runner = RequestRunner(cluster, max_body_bytes, max_queue,
                           chat_specials=special_tokens(cluster.tokenizer) if chat_special_tokens == "refuse" else (),
                           tool_parser=PARSERS.get(tool_call_parser), max_queue_per_client=max_queue_per_client)
    app.state.cluster, app.state.metrics = cluster, metrics

    @app.exception_handler(HTTPError)
    async def _http_error(_request, exc: HTTPError):
        metrics.refused(exc.status, exc.admission)
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _bad_query(_request, exc: RequestValidationError):
        """A route's query parameter of the wrong kind (e.g. /admin/timeline?n=abc): an OpenAI
        error object naming it, not FastAPI's {"detail": ...}."""
        metrics.refused(400)
        err = (exc.errors() or [{}])[0]
        param = str(err.get("loc", ("",))[-1]) or None
        return error_response(400, f"invalid {param!r}: {err.get('msg', 'bad value')}", "invalid_request_error",
                              param, None)

    @app.exception_handler(StarletteHTTPException)
    async def _route_error(request, exc: StarletteHTTPException):
        """Unknown routes and methods: OpenAI error objects too, not FastAPI's {"detail": ...}."""
        metrics.refused(exc.status_code)
        message = (f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405)
                   else str(exc.detail))
        return error_response(exc.status_code, message, "invalid_request_error", None, exc.headers)

    add_openai_routes(app, cluster, runner, model_name, options)
    add_model_routes(app, cluster, model_name)
    add_token_routes(app, cluster, runner, model_name)
    add_operations_routes(app, cluster, metrics)
    if options.load_tracking:
        @app.get("/load")
        async def load():
            """vLLM's --enable-server-load-tracking: the requests (sequences) in flight now."""
            return {"server_load": runner.inflight}

    app.add_middleware(GuardMiddleware, api_key=api_key, admin_key=admin_key, max_body_bytes=max_body_bytes,
                       on_refuse=metrics.refused, root_path=root_path.rstrip("/"))
    install_openapi(app)
    return app


def add_openai_routes(app: FastAPI, cluster: ServingCluster, runner: RequestRunner, model_name: str,
                      options: ServerOptions) -> None:
    """/v1/completions, /v1/chat/completions (one request path, two renderings) and SageMaker's
    /invocations (either, by the body)."""

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await runner.parse(request, CompletionRequest)
        check_model(req)
        prompts = [(text if req.truncate_prompt_tokens is None else None, truncated(req, ids))
                   for text, ids in completion_prompts(req, cluster.tokenizer)]
        return await serve(request, req, prompts, [await runner.params(req, ids, 16) for _, ids in prompts],
                           chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = await runner.parse(request, ChatCompletionRequest)
        check_model(req)
        if req.max_completion_tokens is not None and req.max_tokens is None:
            req.max_tokens = req.max_completion_tokens
        ids = chat_ids(cluster, req.messages, tools=[t.model_dump(exclude_none=True) for t in req.tools or []] or None,
                       refuse=runner.chat_specials, **req.template_kwargs())
        ids = truncated(req, ids)
        return await serve(request, req, [(None, ids)], [await runner.params(req, ids, None)], chat=True)

    @app.post("/invocations")
    async def invocations(request: Request):
        """SageMaker's one route (vLLM's): a body with "messages" is a chat completion, else a completion."""
        body = decode_json(await request.body())
        return await (chat if isinstance(body, dict) and "messages" in body else completions)(request)

    def check_model(req) -> None:
        check_model_name(req, cluster, model_name)

    def truncated(req, ids: list[int]) -> list[int]:
        try:
            return req.truncated(ids, cluster.max_model_len)
        except ValueError as e:  # InvalidParam
            raise HTTPError(400, str(e), param=e.param) from None

    async def serve(request: Request, req, prompts: list[tuple[str | None, list[int]]], params: list[ValidRequest],
                    chat: bool):
        """Both endpoints: run the request's sequences (its prompts x n), render them as the
        endpoint's OpenAI shape: choice index = prompt i x n + copy j, usage summed."""
        seqs = sequences(prompts, params)
        check_work(prompts, params, options.request_token_limit(cluster.max_model_len))
        client = client_of(request)
        runner.admit(len(seqs), len(prompts), client)
        for r in params:
            app.state.metrics.on_params(r.params.n, r.params.max_tokens)
        prefix = "chatcmpl" if chat else "cmpl"
        rid, created = f"{prefix}-{uuid.uuid4().hex}", int(time.time())
        n_prompt = sum(len(ids) for _, ids in prompts)
        tools = req.tool_calls(runner.tool_parser) if chat else None  # params() has refused a bad tool_choice
        if req.return_tokens_as_token_ids is None:
            req.return_tokens_as_token_ids = options.return_tokens_as_token_ids
        renders = renderers(req, chat, seqs, rid, created, model_name, cluster.tokenizer, tools)
        if not req.stream:
            outs = await runner.run_to_end(seqs, request, client)
            for out in outs:
                check_final(out)
            share_prompt_logprobs(seqs, outs)
            cached = sum(outs[i].num_cached_tokens for i in first_copies(seqs))

            def whole() -> bytes:  # off the event loop: 8 x 4 copies' prompt log-probs (5 MB) held /health 1.3 s
                extra = renders[0].extras(outs[0], unasked=True) if chat else {}  # chat: at the top level
                extra["kv_transfer_params"] = handoff_facts(outs[0]) if req.kv_transfer_params is not None else None
                return json_bytes(renders[0].body([r.final(o) for r, o in zip(renders, outs)],
                                                  usage(n_prompt, generated(renders, outs), cached), extra))
            return Response(await asyncio.to_thread(whole), media_type="application/json", headers=headers_of(outs[0]))
        gen = runner.merged(seqs, client)
        first = await runner.first_output(gen)
        if failure(first[1]) is not None:  # before any byte: a plain HTTP error, not a 200 stream
            await gen.aclose()
            check_final(first[1])
        opts = req.stream_options
        include_usage = bool(opts and opts.include_usage) or options.force_include_usage  # continuous: only asked
        return StreamingResponse(stream_body(gen, first, renders, seqs, n_prompt, include_usage,
                                             bool(opts and opts.include_usage and opts.continuous_usage_stats)),
                                 media_type="text/event-stream", headers=headers_of(first[1]))


def add_model_routes(app: FastAPI, cluster: ServingCluster, model_name: str) -> None:
    """/v1/models and /v1/models/{id}: the one served model's card."""
    card = {"id": model_name, "object": "model", "created": 0, "owned_by": "pdserve",
            "max_model_len": cluster.max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        """The openai client's models.retrieve(id)."""
        if model_id not in (model_name, cluster.model_path):
            raise HTTPError(404, f"model {model_id!r} does not exist; this server serves {model_name!r}",
                            param="model")
        return card


def renderers(req, chat: bool, seqs, rid: str, created: int, model_name: str, tokenizer,
              tools: ToolCalls | None) -> list[Renderer]:
    """One renderer per sequence (choice index i), with what the request asked of its replies
    (`tools`: a chat request's tool mode)."""
    return [Renderer(chat, rid, created, model_name, tokenizer, top_n=s.request.params.logprobs or 0,
                     echo=echo_text(req, chat, s, tokenizer), index=i, tools=tools,
                     prompt_ids=s.request.prompt_token_ids,
                     vllm_prompt_logprobs=req.prompt_logprobs is not None, token_ids=req.return_token_ids,
                     scores_only=getattr(req, "scores_only", False), asked_ids=tuple(req.logprob_token_ids or ()),
                     as_ids=bool(req.return_tokens_as_token_ids))
            for i, s in enumerate(seqs)]


def completion_prompts(req, tokenizer) -> list[tuple[str | None, list[int]]]:
    """OpenAI's prompt: a string, a token list, or a batch of either (one choice per prompt
    and copy)."""
    prompt = req.prompt
    batch = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) else [prompt]
    return [(p, tokenizer.encode(p)) if isinstance(p, str) else (None, list(p)) for p in batch]


def echo_text(req, chat: bool, s, tokenizer) -> str:
    """echo: completions put the prompt's text before the completion's; chat the last
    message's when it is the assistant's (vLLM's)."""
    if not req.echo:
        return ""
    if chat:
        return req.messages[-1].text() if req.messages[-1].role == "assistant" else ""
    return s.text if s.text is not None else tokenizer.decode(s.request.prompt_token_ids)


def handoff_facts(out) -> dict:
    """What pdserve did with a request's KV, returned in vLLM's kv_transfer_params (a PD proxy
    sends that field; pdserve moves KV itself, so it accepts the proxy's and answers with its own)."""
    return {"prefill_worker": out.prefill_worker, "decode_worker": out.decode_worker,
            "kv_handoff": out.prefill_worker is not None and out.prefill_worker != out.decode_worker,
            "num_cached_tokens": out.num_cached_tokens}


def generated(renders: list[Renderer], outs) -> int:
    """The completion tokens a reply counts (none for a prompt scored alone: max_tokens 0)."""
    return sum(len(o.outputs[0].token_ids) for r, o in zip(renders, outs) if not r.scores_only)


def share_prompt_logprobs(seqs, outs) -> None:
    """A prompt's log-probs come with its first copy (SamplingParams.samples()); its other
    copies' choices show the same."""
    scored = {s.prompt: o for s, o in zip(seqs, outs) if o.prompt_logprobs}
    for s, o in zip(seqs, outs):
        if not o.prompt_logprobs and s.prompt in scored:
            o.prompt_logprobs, o.prompt_ranks = scored[s.prompt].prompt_logprobs, scored[s.prompt].prompt_ranks


async def stream_body(gen, first, renders: list[Renderer], seqs, n_prompt: int, include_usage: bool,
                      continuous: bool):
    """The SSE events of a streamed request's sequences (runner.merged: (index, delta output)),
    from the first (already awaited) one. A sequence's opening chunk (chat's role, an echoed
    prompt, vLLM's extras) goes out with its first output; the prompt's log-probs come with its
    first copy's, which starts before the others (runner.merged). continuous: every chunk
    carries the usage so far (vLLM's continuous_usage_stats): the tokens its choices carry and
    those before them, none on an opening chunk."""
    (i, out), n_out, left = first, 0, len(renders)
    opened, scored = set(), {}
    try:
        while True:
            err = failure(out)
            if err is not None:
                if err.status != 499:
                    yield sse(error_body(err.message, err.type, err.param, err.status))
                break
            before = n_out  # the opening chunk counts none of this output's tokens
            n_out += 0 if renders[i].scores_only else len(out.delta_token_ids)
            so_far = {"usage": usage(n_prompt, n_out)} if continuous else {}
            r = renders[i]
            if i not in opened:
                opened.add(i)
                if out.prompt_logprobs:
                    scored[seqs[i].prompt] = (out.prompt_logprobs, out.prompt_ranks)
                out.prompt_logprobs, out.prompt_ranks = scored.get(seqs[i].prompt, (None, None))
                opening = r.opening(out)
                if opening is not None:
                    yield r.chunk([opening], **({"usage": usage(n_prompt, before)} if continuous else {}),
                                  **(r.extras(out) if r.chat and not opened - {i} else {}))
            for choice in r.choices(out):
                yield r.chunk([choice], **so_far)
            left -= out.finished
            if not left:
                if include_usage:
                    yield renders[0].chunk([], usage=usage(n_prompt, n_out))
                break
            i, out = await gen.__anext__()
        yield "data: [DONE]\n\n"
    finally:
        await gen.aclose()


def add_operations_routes(app: FastAPI, cluster: ServingCluster, metrics: RouterMetrics) -> None:
    """/version, /health, /metrics, /admin/scale, /admin/slo, /admin/status, /admin/timeline."""

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/health")
    async def health():
        """200 while requests can be served, 503 when a pool they need is empty; "degraded" names
        what is missing (an empty pool, a worker silent to the probe, a KV link down, the block
        registry away, the monitor failing)."""
        h = cluster.health()
        pools = h["pools"]
        serving = pools["decode"] > 0 and (pools["prefill"] > 0 or cluster.mode in ("colocated", "hybrid"))
        whole = pools["decode"] > 0 and (pools["prefill"] > 0 or cluster.mode == "colocated") and \
            not h["unresponsive"] and not h["kv_links_down"] and h["registry"]["status"] == "ok" and \
            h["monitor"]["status"] == "ok"
        return JSONResponse({"status": "ok" if whole else "degraded", **h}, status_code=200 if serving else 503)

    @app.get("/metrics")
    async def prom():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/admin/scale")
    async def scale(request: Request):
        data = decode_json(await request.body())
        if not isinstance(data, dict) or not set(data) <= {"prefill", "decode", "switch_roles"} or \
                not set(data) & {"prefill", "decode"}:
            raise HTTPError(400, 'body must be {"prefill": n, "decode": m} (either or both; '
                                 '"switch_roles": true moves workers between the pools)')
        if not isinstance(data.get("switch_roles", False), bool):
            raise HTTPError(400, f"switch_roles must be true or false, got {data['switch_roles']!r}",
                            param="switch_roles")
        for k, v in data.items():
            if k != "switch_roles" and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise HTTPError(400, f"{k} must be an integer >= 1, got {v!r}", param=k)
        try:
            sizes = await asyncio.get_running_loop().run_in_executor(None, lambda: cluster.scale(**data))
        except ValueError as e:  # e.g. outside the autoscaler's bounds
            raise HTTPError(400, str(e)) from None
        return {"pools": sizes}

    @app.get("/admin/status")
    async def status():
        rows = await asyncio.get_running_loop().run_in_executor(None, cluster.status)
        snap = cluster.snapshot()
        counts = cluster.counters
        return {"pools": snap.pool_sizes, "workers": rows, "routing": snap.routing,
                "requests": {"total": counts["requests"], "retries": counts["retries"], "failed": counts["failed"]},
                "registry": cluster.health()["registry"],
                "autoscale": {"enabled": snap.autoscale_enabled, "events": snap.autoscale_events,
                              **({"ratio_plan": snap.autoscale_plan} if snap.autoscale_plan is not None else {})}}

    @app.get("/admin/slo")
    async def current_slo():
        """The SLO placement serves now (what `pdserve bench` measures attainment against)."""
        return {"slo": cluster.slo()}

    @app.post("/admin/slo")
    async def slo(request: Request):
        """{"ttft_s": x, "tpot_s": y} (either or both): the SLO hybrid placement serves, live."""
        data = decode_json(await request.body())
        if not isinstance(data, dict) or not data or not set(data) <= {"ttft_s", "tpot_s"}:
            raise HTTPError(400, 'body must be {"ttft_s": seconds, "tpot_s": seconds} (either or both)')
        try:
            return {"slo": await asyncio.get_running_loop().run_in_executor(None, lambda: cluster.set_slo(**data))}
        except ValueError as e:
            raise HTTPError(400, str(e)) from None

    @app.get("/admin/timeline")
    async def timeline(n: int = 1000):
        """The latest requests' spans (wall-clock seconds) and phases before the first token."""
        return {"requests": cluster.timeline(max(0, min(n, 100000)))}
