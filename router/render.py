"""OpenAI response bodies for both endpoints, from pdserve outputs: one renderer with
the two shapes (text completion / chat completion) as data, not as twin handlers.

    final(out)             the non-streaming choice of a finished (cumulative) output
    body(choices, usage)   the non-streaming body
    opening()              the first SSE chunk: chat's assistant role, text's echoed prompt (or None)
    logprobs(...)          OpenAI's log-probs object of either shape
    choices(out)           the SSE choices of one delta output (empty when it adds nothing)
    chunk(choices, ...)    one SSE event
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from pdserve.engine.outputs import RequestOutput

from .tools import ToolCalls


def usage(n_prompt: int, n_out: int, n_cached: int = 0) -> dict:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out,
            "prompt_tokens_details": {"cached_tokens": n_cached}}


def sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


LOGPROB_FLOOR = -9999.0  # what a log-prob of -inf (a token the request's masks ruled out) is shown as, as vLLM


def finite(e: dict[int, float] | None) -> dict[int, float] | None:
    """A token's log-probs with every value a finite JSON number: -inf and NaN (a masked token:
    allowed_token_ids, logit_bias, a grammar) become LOGPROB_FLOOR. JSON has no infinity, and
    JavaScript, Go and serde refuse the `-Infinity` Python would write."""
    if e is None:
        return None
    return {t: v if v > LOGPROB_FLOOR else LOGPROB_FLOOR for t, v in e.items()}  # NaN fails the test too


def headers_of(out: RequestOutput) -> dict:
    """The workers that served the request (debugging, tests)."""
    return {"x-pdserve-prefill": out.prefill_worker or "", "x-pdserve-decode": out.decode_worker or ""}


@dataclass
class Renderer:
    chat: bool
    request_id: str
    created: int
    model: str
    tokenizer: object = None  # for log-probs: each token's text
    top_n: int = 0  # top log-probs per token
    echo: str = ""  # completions' echo: the prompt's text, before the completion's
    index: int = 0  # the choice (n > 1: one renderer per sequence)
    tools: ToolCalls | None = None  # chat with tool_choice required / named: the reply is calls (tools.py)
    prompt_ids: list[int] | None = None  # the sequence's prompt (echoed log-probs, return_token_ids)
    vllm_prompt_logprobs: bool = False  # the request asked for vLLM's prompt_logprobs field
    token_ids: bool = False  # vLLM's return_token_ids
    scores_only: bool = False  # completions' max_tokens 0 with echo: the generated token is dropped
    asked_ids: tuple[int, ...] = ()  # vLLM's logprob_token_ids: in each token's top log-probs too
    as_ids: bool = False  # vLLM's return_tokens_as_token_ids: a log-prob's token is "token_id:<id>"

    def token(self, t: int) -> str:
        """A token as log-probs name it."""
        return f"token_id:{t}" if self.as_ids else self.tokenizer.decode([t])

    def tops(self, e: dict[int, float], token: int) -> list[tuple[int, float]]:
        """A token's top log-probs: its top N, best first; with vLLM's logprob_token_ids, what
        vLLM returns instead: the sampled `token`, then exactly the ids the request named."""
        if self.asked_ids:
            return [(token, e[token])] + [(t, e[t]) for t in dict.fromkeys(self.asked_ids) if t in e and t != token]
        return sorted(e.items(), key=lambda kv: -kv[1])[:self.top_n]

    def logprobs(self, entries: list[dict[int, float]] | None, token_ids: list[int], offset: int = 0):
        """OpenAI's log-probs object for these tokens (None when the request asked for none).
        An entry is {sampled id: log-prob, top ids: log-probs}; its top N, best first."""
        if entries is None:
            return None
        entries = [finite(e) for e in entries]
        name, tops = self.token, [self.tops(e, t) for e, t in zip(entries, token_ids)]
        if self.chat:
            def item(t: int, v: float) -> dict:
                return {"token": name(t), "logprob": v, "bytes": list(self.tokenizer.decode([t]).encode())}

            return {"content": [{**item(t, e[t]), "top_logprobs": [item(u, w) for u, w in top]}
                                for t, e, top in zip(token_ids, entries, tops)]}
        tokens = [name(t) for t in token_ids]
        offsets = []
        for t in token_ids:
            offsets.append(offset)
            offset += len(self.tokenizer.decode([t]))
        return {"tokens": tokens, "token_logprobs": [e[t] for t, e in zip(token_ids, entries)],
                "top_logprobs": [{s: e[t], **{name(u): w for u, w in top}}  # the sampled token too (vLLM)
                                 for s, t, e, top in zip(tokens, token_ids, entries, tops)], "text_offset": offsets}

    def prompt_logprobs(self, entries: list[dict[int, float] | None]) -> dict:
        """Completions' echo with logprobs: the prompt's part of the log-probs object (its first
        token has none, as OpenAI's legacy API gives it)."""
        entries = [finite(e) for e in entries]
        offsets, at = [], 0
        for t in self.prompt_ids:
            offsets.append(at)
            at += len(self.tokenizer.decode([t]))
        return {"tokens": [self.token(t) for t in self.prompt_ids],
                "token_logprobs": [e and e[t] for t, e in zip(self.prompt_ids, entries)],
                # the prompt's own token first, then the top ones (vLLM builds them so)
                "top_logprobs": [e and {self.token(t): e[t], **{self.token(u): w for u, w in
                                                                 sorted(e.items(), key=lambda kv: -kv[1])}}
                                 for t, e in zip(self.prompt_ids, entries)], "text_offset": offsets}

    def vllm_logprobs(self, out: RequestOutput) -> list | None:
        """vLLM's `prompt_logprobs`: per prompt token None (the first) or {id: {logprob, rank,
        decoded_token}} for the token (its rank among the whole vocabulary, from the engine) and
        the top N (ranks 1..N)."""
        if out.prompt_logprobs is None:
            return None
        ranks = out.prompt_ranks or [None] * len(out.prompt_logprobs)
        res = []
        for t, e, rank in zip(self.prompt_ids, map(finite, out.prompt_logprobs), ranks):
            if e is None:
                res.append(None)
                continue
            top = sorted((u for u in e if u != t), key=lambda u: -e[u])
            place = {u: r for r, u in enumerate(top, 1)}
            place = {u: (r + 1 if rank is not None and rank <= r else r) for u, r in place.items()}  # t before them
            res.append({str(u): {"logprob": v, "rank": rank if u == t else place[u],
                                 "decoded_token": self.tokenizer.decode([u])} for u, v in e.items()})
        return res

    def extras(self, out: RequestOutput, unasked: bool = False) -> dict:
        """vLLM's extra fields asked for: prompt_logprobs, prompt_token_ids (a completion's
        choice carries them; chat puts them at the top level: app.serve, stream_body).
        `unasked`: a whole (non-streamed) reply has both keys, null where not asked, as vLLM's."""
        extra = {"prompt_logprobs": None, "prompt_token_ids": None} if unasked else {}
        if self.vllm_prompt_logprobs:
            extra["prompt_logprobs"] = self.vllm_logprobs(out)
        if self.token_ids:
            extra["prompt_token_ids"] = list(self.prompt_ids or [])
        return extra

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def final(self, out: RequestOutput) -> dict:
        """The non-streaming choice of a finished (cumulative) output."""
        if self.scores_only:
            out = self.prompt_alone(out)
        c = out.outputs[0]
        choice = {"index": self.index, "logprobs": self.with_echo(out, self.logprobs(c.logprobs, c.token_ids,
                                                                                      len(self.echo))),
                  "finish_reason": c.finish_reason}
        if self.chat:
            content, calls = self.tools.reply(c.text, c.finish_reason) if self.tools is not None else (c.text, None)
            choice["message"] = {"role": "assistant", "content": None if content is None else self.echo + content}
            if calls is not None:
                choice["message"]["tool_calls"], choice["finish_reason"] = calls, "tool_calls"
        else:
            choice["text"] = self.echo + c.text
            choice.update(self.extras(out, unasked=True))
        if self.token_ids:
            choice["token_ids"] = list(c.token_ids)
        return choice

    @staticmethod
    def prompt_alone(out: RequestOutput) -> RequestOutput:
        """The output without its generated token (scores_only), finished by length."""
        c = out.outputs[0]
        empty = dataclasses.replace(c, text="", token_ids=[], logprobs=[] if c.logprobs is not None else None,
                                    finish_reason="length" if out.finished else None)
        return dataclasses.replace(out, outputs=[empty], delta_text="", delta_token_ids=[])

    def with_echo(self, out: RequestOutput, lp: dict | None) -> dict | None:
        """Completions' echo with logprobs: the prompt's log-probs before the completion's."""
        if self.chat or not self.echo or lp is None or not out.prompt_logprobs:
            return lp
        head = self.prompt_logprobs(out.prompt_logprobs)
        return {k: head[k] + lp[k] for k in head}

    def body(self, choices: list[dict], usage_: dict, extra: dict | None = None) -> dict:
        return {"id": self.request_id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": usage_, **(extra or {})}

    def __post_init__(self) -> None:
        self._offset = len(self.echo)  # streamed text so far (log-probs' text_offset)
        self._held = ""  # tool mode: the reply, held until it is whole
        self._sent = 0  # tool mode (auto): how much of it went out as content

    def opening(self, first: RequestOutput) -> dict | None:
        """The first chunk's choice (`first`: the sequence's first output, for the echoed
        prompt's log-probs and vLLM's extras); None when there is none."""
        if not self.chat:
            extra = self.extras(first)
            if not self.echo and not extra:
                return None
            asked = first.outputs and first.outputs[0].logprobs is not None  # echo + logprobs
            lp = self.prompt_logprobs(first.prompt_logprobs) if self.echo and asked and first.prompt_logprobs else None
            return {"index": self.index, "text": self.echo, "logprobs": lp, "finish_reason": None, **extra}
        return {"index": self.index, "delta": {"role": "assistant", "content": self.echo}, "logprobs": None,
                "finish_reason": None}

    def choices(self, out: RequestOutput) -> list[dict]:
        if self.scores_only:
            out = self.prompt_alone(out)
        c = out.outputs[0]
        reason = c.finish_reason if out.finished else None
        lp = self.logprobs(c.logprobs, out.delta_token_ids, self._offset) if out.delta_token_ids else None
        self._offset += len(out.delta_text)
        # every id reaches the client once, in order, whatever the text does (the bytes of a
        # character not complete yet, a stop token that adds no text): a chunk carries them
        ids = {"token_ids": list(out.delta_token_ids)} if self.token_ids else {}
        if not self.chat:
            if not (out.delta_text or out.finished or lp or ids.get("token_ids")):
                return []
            return [{"index": self.index, "text": out.delta_text, "logprobs": lp, "finish_reason": reason, **ids}]
        if self.tools is not None:
            return self._tool_choices(out, lp, reason, ids)
        said = out.delta_text or lp or ids.get("token_ids")
        if not (said or out.finished):
            return []
        # the last tokens and the finish reason in one chunk, as vLLM sends them (a client
        # counting continuous usage sees each chunk with choices add tokens)
        return [{"index": self.index, "delta": {"content": out.delta_text} if said else {}, "logprobs": lp,
                 "finish_reason": reason, **ids}]

    def _tool_choices(self, out: RequestOutput, lp, reason, ids: dict) -> list[dict]:
        """Tool mode: log-probs as they come; content as far as no call may have begun (auto);
        the calls (or, cut short, the text) at the end, each call whole in one delta (clients
        join a call's argument deltas by index)."""
        self._held += out.delta_text
        choices = [{"index": self.index, "delta": {}, "logprobs": lp, "finish_reason": None, **ids}] \
            if lp or ids.get("token_ids") else []
        safe = self.tools.streamable(self._held) if not out.finished else self._sent
        if safe > self._sent:
            choices.append({"index": self.index, "delta": {"content": self._held[self._sent:safe]}, "logprobs": None,
                            "finish_reason": None})
            self._sent = safe
        if out.finished:
            content, calls = self.tools.reply(self._held, reason)
            rest = (content or "")[self._sent:] if calls is None or self._sent else (content or "")
            deltas = ([{"content": rest}] if rest else []) + \
                ([{"tool_calls": [{"index": k, **call} for k, call in enumerate(calls)]}] if calls else [])
            choices += [{"index": self.index, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas]
            choices.append({"index": self.index, "delta": {}, "logprobs": None,
                            "finish_reason": reason if calls is None else "tool_calls"})
        return choices

    def chunk(self, choices: list, **extra) -> str:
        return sse({"id": self.request_id, "object": f"{self.object}.chunk" if self.chat else self.object,
                    "created": self.created, "model": self.model, "choices": choices, **extra})


def json_bytes(body: dict) -> bytes:
    """A response body as JSONResponse writes it (compact, UTF-8, no NaN)."""
    return json.dumps(body, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")
