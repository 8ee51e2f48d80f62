"""One HTTP request's way to the cluster and back, shared by both OpenAI endpoints:

    parse()       body size, JSON, the pydantic model          -> 400 / 413 naming the field
    params()      sampling values + the one validation of the request against the model
                  (cluster.validate -> engine/validation.py)    -> 400 naming the field
    admit()       a slot of the bounded queue per sequence      -> 429 + Retry-After
                  (a request larger than the whole queue: 400), at most
                  max_queue_per_client of them held by one client (its address)
    outputs()     the cluster's delta outputs as an async generator; stopping early
                  (a client that went away) cancels the request on every worker
    merged()      the sequences of a request (its prompts x n), tagged with their index
    run_to_end()  non-streaming: each sequence's final output, accumulated once here
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import json
import logging
import math
import re

from fastapi import Request
from pydantic import ValidationError

from pdserve.cluster.api import NoWorker
from pdserve.engine.base.grammar_spec import BUDGET, nesting_depth
from pdserve.engine.outputs import Accumulator, RequestOutput
from pdserve.engine.sample.structured import Grammars
from pdserve.engine.validation import InvalidRequest, ValidRequest

from .errors import HTTPError
from .options import request_work
from .schemas import screen

log = logging.getLogger(__name__)
MAX_JSON_DEPTH = 64  # a body nested deeper is refused (1000 deep once ended in a RecursionError: a 500)


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def decode_json(body: bytes):
    """A request body as JSON; HTTPError 400 naming what is wrong: malformed, not UTF-8,
    NaN / Infinity (not JSON, and no sampling value may be one), or nested too deep."""
    too_deep = HTTPError(400, f"the JSON body nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        data = json.loads(body, parse_constant=_no_constant)
    except RecursionError:
        raise too_deep from None
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise HTTPError(400, f"malformed JSON body: {e}") from None
    if nesting_depth(data) > MAX_JSON_DEPTH:
        raise too_deep
    return data


def grammar_param(req) -> str:
    """The request field a grammar came from, for the 400 that refuses it."""
    if getattr(req, "tool_choice", None) not in (None, "none"):
        return "tools"
    return next((f for f in ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
                 if getattr(req, f, None) is not None), "response_format")


@dataclasses.dataclass(frozen=True)
class Sequence:
    """One sequence a request asks for: prompt `prompt` of the request's prompts (completions
    take a batch), one of its n copies (SamplingParams.samples())."""
    prompt: int
    text: str | None
    request: ValidRequest  # what the cluster runs (validated once, RequestRunner.params)


def sequences(prompts: list[tuple[str | None, list[int]]], requests: list[ValidRequest]) -> list[Sequence]:
    """The request's sequences in OpenAI's choice order: index = prompt i x n + copy j."""
    return [Sequence(k, text, c) for k, ((text, _), r) in enumerate(zip(prompts, requests)) for c in r.samples()]


def first_copies(seqs: list[Sequence]) -> list[int]:
    """The index of each prompt's first copy."""
    first: dict[int, int] = {}
    for i, s in enumerate(seqs):
        first.setdefault(s.prompt, i)
    return list(first.values())


class _Done:
    def __init__(self, fut):
        self.fut = fut


def per_client_share(max_queue: int) -> int:
    """The default --max-queue-per-client: three quarters of the queue, so one client (a script
    that opens streams and reads none) leaves a quarter of the slots to everyone else."""
    return max(1, max_queue * 3 // 4)


def client_of(request: Request) -> str:
    """Whom admission counts a request against: its connection's source address."""
    return request.client.host if request.client else ""


class RequestRunner:
    def __init__(self, cluster, max_body_bytes: int, max_queue: int, chat_specials: tuple[str, ...] = (),
                 tool_parser=None, max_queue_per_client: int | None = None):
        """`chat_specials`: the special tokens a chat message may not spell (none: allowed);
        `tool_parser`: the tool_parsers.ToolParser that serves tool_choice auto (None: refused);
        `max_queue_per_client`: the queue's slots one client (connection source) may hold at once
        (None: per_client_share(max_queue); max_queue: no bound of its own)."""
        self.cluster, self.max_body_bytes, self.max_queue = cluster, max_body_bytes, max_queue
        self.max_per_client = per_client_share(max_queue) if max_queue_per_client is None else max_queue_per_client
        self.inflight = 0
        self.held: collections.Counter[str] = collections.Counter()  # slots by client
        self.chat_specials, self.tool_parser = chat_specials, tool_parser
        self.grammars = Grammars(lambda: cluster.tokenizer, cluster.vocab_size)  # compiled lazily, cached (bounded)
        # grammars compile here, off the event loop (xgrammar releases the GIL): one slow
        # grammar never stalls /health or other requests, and two threads bound what they take
        self.compiling = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="grammar")

    async def parse(self, request: Request, model_cls):
        kind = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
        if kind and kind != "application/json" and not kind.endswith("+json"):
            raise HTTPError(415, f"the body must be JSON (Content-Type: application/json), got {kind!r}")
        body = await request.body()
        if len(body) > self.max_body_bytes:
            raise HTTPError(413, f"request body of {len(body)} bytes exceeds the limit of {self.max_body_bytes}")
        data = decode_json(body)
        if not isinstance(data, dict):
            raise HTTPError(400, "the JSON body must be an object")
        try:  # JSON's \u escapes can spell lone surrogates, which no tokenizer takes
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            raise HTTPError(400, f"the body holds text that is not valid Unicode: {e.reason}") from None
        try:
            return model_cls.model_validate(screen(data))
        except ValueError as e:
            if not isinstance(e, ValidationError):  # screen(): a parameter not implemented yet
                raise HTTPError(400, e.args[0], param=e.args[1]) from None
            err = e.errors()[0]
            loc = err.get("loc", ())
            if not loc:  # a check across fields (a model validator): its message names the field first
                msg = str(err.get("msg", "")).removeprefix("Value error, ")
                raise HTTPError(400, msg, param=re.match(r"[a-z_]*", msg).group() or None) from None
            param = str(loc[0])  # the body's field (not the union branch pydantic tried)
            if err.get("type") == "extra_forbidden":
                raise HTTPError(400, f"unknown parameter {param!r}", param=param) from None
            kind = f" [type={err['type']}]" if err.get("type") else ""  # pydantic's error type, as vLLM shows it
            raise HTTPError(400, f"invalid field {field_path(loc)!r}: {err.get('msg')}{kind}",
                            param=param or None) from None

    async def params(self, req, ids: list[int], default_max: int | None) -> ValidRequest:
        """The prompt `ids` and the request's sampling parameters, validated (the request's one
        validation: cluster.validate); raises HTTPError 400 naming the field."""
        try:
            params = req.sampling_params(default_max, self.tool_parser)
        except ValueError as e:  # InvalidParam names the field; a grammar's is the field it came from
            param = getattr(e, "param", None)
            raise HTTPError(400, str(e), param=grammar_param(req) if param == "structured_outputs" else param) from None
        try:
            valid = self.cluster.validate(ids, params)
            if params.structured_outputs:  # a grammar that does not compile: refused before queueing
                await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(
                    self.compiling, self.grammars.check, params.structured_outputs), BUDGET.compile_timeout_s)
        except InvalidRequest as e:
            raise HTTPError(400, str(e), param=e.param) from None
        except asyncio.TimeoutError:
            raise HTTPError(400, f"{grammar_param(req)}: the grammar did not compile within "
                                 f"{BUDGET.compile_timeout_s:g} s (make it smaller or simpler)",
                            param=grammar_param(req)) from None
        except ValueError as e:  # the grammar: of a tool's parameters, or of response_format / guided_*
            raise HTTPError(400, str(e), param=grammar_param(req)) from None
        return valid

    def admit(self, n: int = 1, prompts: int = 1, client: str = "") -> None:
        """Takes n slots of the bounded queue (one per sequence: `prompts` x the request's n) for
        `client`; merged() gives them back. A request larger than the whole queue (or than one
        client's share) is a 400 naming what to cut (a 429 would be retried forever); one client
        holding its share gets a 429 while other clients are admitted."""
        most = min(self.max_queue, self.max_per_client)
        if n > most:
            param = "prompt" if prompts > most else "n"
            flag = "--max-queue" if most == self.max_queue else "--max-queue-per-client"
            raise HTTPError(400, f"{param}: {prompts} prompt(s) x n = {n} sequences, more than this server ever runs "
                                 f"for one request at once ({flag} {most}): send fewer", param=param)
        if self.inflight + n > self.max_queue:
            raise HTTPError(429, f"server busy: {self.inflight} requests in flight (limit {self.max_queue})",
                            "rate_limit_error", headers={"Retry-After": "1"}, admission="queue_full")
        if self.held[client] + n > self.max_per_client:
            raise HTTPError(429, f"too many requests from this client: {self.held[client]} in flight (limit "
                                 f"{self.max_per_client} a client, --max-queue-per-client)",
                            "rate_limit_error", headers={"Retry-After": "1"}, admission="client_full")
        self.inflight += n
        self.held[client] += n

    def release(self, n: int, client: str) -> None:
        """Gives back what admit() took."""
        self.inflight -= n
        self.held[client] -= n
        if not self.held[client]:
            del self.held[client]

    async def merged(self, seqs: list[Sequence], client: str = "", stream: bool = True):
        """(index, delta output) of a request's sequences (its prompts x n) as they come. A
        prompt's first copy starts at once, its other copies once that one has its first
        output, so they find the prompt's blocks in the prefix cache. Gives back the queue
        slots admit() took for `client`."""
        q: asyncio.Queue = asyncio.Queue()
        done = object()

        async def pump(i: int) -> None:
            s = seqs[i]
            try:
                async for out in self.outputs(s.text, s.request, stream):
                    q.put_nowait((i, out))
            except Exception as e:  # noqa: BLE001 - handed to the consumer
                q.put_nowait((i, e))
            q.put_nowait((i, done))

        firsts = first_copies(seqs)
        followers = {i: [j for j, s in enumerate(seqs) if s.prompt == seqs[i].prompt and j != i] for i in firsts}
        tasks = [asyncio.ensure_future(pump(i)) for i in firsts]
        left = len(seqs)
        try:
            while left:
                i, item = await q.get()
                if not isinstance(item, Exception):  # a first copy's first output, or its end
                    tasks += [asyncio.ensure_future(pump(j)) for j in followers.pop(i, ())]
                if item is done:
                    left -= 1
                    continue
                if isinstance(item, Exception):
                    raise item
                yield i, item
        finally:
            for t in tasks:
                t.cancel()  # a sequence still running is cancelled on every worker (outputs())
            self.release(len(seqs), client)

    async def outputs(self, text: str | None, request: ValidRequest, stream: bool = True):
        """Yields the request's delta outputs as the cluster produces them (stream=False: at its
        end; ServingCluster.submit); cancels the request if the consumer stops early (client
        disconnect)."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        fut = self.cluster.submit(text, request, lambda out: loop.call_soon_threadsafe(q.put_nowait, out), stream)
        fut.add_done_callback(lambda f: loop.call_soon_threadsafe(q.put_nowait, _Done(f)))
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, _Done):
                    exc = item.fut.exception() if not item.fut.cancelled() else None
                    if isinstance(exc, ValueError):
                        raise HTTPError(400, str(exc), param=getattr(exc, "param", None))
                    if isinstance(exc, NoWorker):
                        raise HTTPError(503, str(exc), "server_error", admission="no_worker",
                                        headers={"Retry-After": str(max(1, math.ceil(exc.retry_after_s)))})
                    if exc is not None:  # a bug: the details go to the log, not to the client
                        log.error("request failed", exc_info=exc)
                        raise HTTPError(500, f"request failed: internal error ({type(exc).__name__}; "
                                             "the server's log has the details)", "server_error")
                    return
                finished = finished or item.finished
                yield item
        finally:
            if not finished:
                fut.cancel()  # aborts on every worker, frees the blocks

    async def run_to_end(self, seqs: list[Sequence], request: Request, client: str = "") -> list[RequestOutput]:
        """Non-streaming: each sequence's final (cumulative) output; cancels if the client
        disconnects first."""
        accs, final = [Accumulator(s.text, s.request.prompt_token_ids) for s in seqs], {}

        async def consume():
            async for i, out in self.merged(seqs, client, stream=False):
                out = accs[i].add(out)
                if out.finished:
                    final[i] = out

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
        if len(final) != len(seqs):
            raise HTTPError(500, "request ended without output", "server_error")
        return [final[i] for i in range(len(seqs))]

    @staticmethod
    async def first_output(gen) -> tuple[int, RequestOutput]:
        """Awaits the first output before the response starts (its workers go in the headers,
        and errors before it are still plain HTTP errors)."""
        try:
            return await gen.__anext__()
        except StopAsyncIteration:
            raise HTTPError(500, "request ended without output", "server_error") from None


_TYPE_TAG = re.compile(r"^(str|int|float|bool|dict|list|none|json-or-python|function-\w+|tagged-union"
                       r"|constrained-\w+)\b|[\[(]")


def field_path(loc: tuple) -> str:
    """The body's path to a field pydantic refused, as a client writes it ("tools[0].function"),
    without the union branches pydantic tried on the way ("list[int]", "str")."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _TYPE_TAG.search(str(part)):
            out += f".{part}" if out else str(part)
    return out


def check_work(prompts: list[tuple[str | None, list[int]]], params: list[ValidRequest], limit: int) -> None:
    """A 400 naming --max-request-tokens for a request that asks for more work than it allows
    (options.request_work): refused before anything runs, not served for minutes while the
    server's other clients wait."""
    asked = [r.params for r in params]
    work = request_work([ids for _, ids in prompts], asked)
    if work <= limit:
        return
    n_prompt = sum(len(ids) for _, ids in prompts)
    scored = any(p.prompt_logprobs is not None for p in asked)
    generated = sum(p.n * p.max_tokens for p in asked)  # the largest part names the field to cut
    param = "prompt_logprobs" if scored and work - generated > generated else "prompt" if work - generated > \
        generated else "n" if any(p.n > 1 for p in asked) else "max_tokens"
    raise HTTPError(400, f"this request asks for up to {work:,} tokens of work ({len(prompts)} prompt(s) of "
                         f"{n_prompt:,} tokens, {sum(p.n for p in asked)} sequence(s) of up to "
                         f"{max(p.max_tokens for p in asked):,} tokens each"
                         + (", the prompts' log-probs on every copy" if scored else "")
                         + f"), more than this server takes for one request (--max-request-tokens {limit:,}): "
                         "lower n or max_tokens, or send fewer prompts", param=param)
