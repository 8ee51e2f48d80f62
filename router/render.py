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

import json
from dataclasses import dataclass

from pdserve.engine.outputs import RequestOutput

from .tools import ToolCalls


def usage(n_prompt: int, n_out: int) -> dict:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_out, "total_tokens": n_prompt + n_out}


def sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


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

    def logprobs(self, entries: list[dict[int, float]] | None, token_ids: list[int], offset: int = 0):
        """OpenAI's log-probs object for these tokens (None when the request asked for none).
        An entry is {sampled id: log-prob, top ids: log-probs}; its top N, best first."""
        if entries is None:
            return None
        text = self.tokenizer.decode
        tops = [sorted(e.items(), key=lambda kv: -kv[1])[:self.top_n] for e in entries]
        if self.chat:
            def item(t: int, v: float) -> dict:
                s = text([t])
                return {"token": s, "logprob": v, "bytes": list(s.encode())}

            return {"content": [{**item(t, e[t]), "top_logprobs": [item(u, w) for u, w in top]}
                                for t, e, top in zip(token_ids, entries, tops)]}
        tokens = [text([t]) for t in token_ids]
        offsets = []
        for s in tokens:
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": [e[t] for t, e in zip(token_ids, entries)],
                "top_logprobs": [{text([u]): w for u, w in top} for top in tops], "text_offset": offsets}

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def final(self, out: RequestOutput) -> dict:
        """The non-streaming choice of a finished (cumulative) output."""
        c = out.outputs[0]
        choice = {"index": self.index, "logprobs": self.logprobs(c.logprobs, c.token_ids, len(self.echo)),
                  "finish_reason": c.finish_reason}
        if self.chat:
            calls = self.tools.calls(c.text, c.finish_reason) if self.tools is not None else None
            choice["message"] = {"role": "assistant", "content": c.text if calls is None else None}
            if calls is not None:
                choice["message"]["tool_calls"], choice["finish_reason"] = calls, "tool_calls"
        else:
            choice["text"] = self.echo + c.text
        return choice

    def body(self, choices: list[dict], usage_: dict) -> dict:
        return {"id": self.request_id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": usage_}

    def __post_init__(self) -> None:
        self._offset = len(self.echo)  # streamed text so far (log-probs' text_offset)
        self._held = ""  # tool mode: the reply, held until it is whole

    def opening(self) -> dict | None:
        if not self.chat:
            if not self.echo:
                return None
            return {"index": self.index, "text": self.echo, "logprobs": None, "finish_reason": None}
        return {"index": self.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}

    def choices(self, out: RequestOutput) -> list[dict]:
        c = out.outputs[0]
        reason = c.finish_reason if out.finished else None
        lp = self.logprobs(c.logprobs, out.delta_token_ids, self._offset) if out.delta_token_ids else None
        self._offset += len(out.delta_text)
        if not self.chat:
            if not (out.delta_text or out.finished or lp):
                return []
            return [{"index": self.index, "text": out.delta_text, "logprobs": lp, "finish_reason": reason}]
        if self.tools is not None:
            return self._tool_choices(out, lp, reason)
        choices = [{"index": self.index, "delta": {"content": out.delta_text}, "logprobs": lp, "finish_reason": None}
                   ] if out.delta_text or lp else []
        if out.finished:
            choices.append({"index": self.index, "delta": {}, "logprobs": None, "finish_reason": reason})
        return choices

    def _tool_choices(self, out: RequestOutput, lp, reason) -> list[dict]:
        """Tool mode: log-probs as they come; the calls (or, cut short, the text) at the end,
        each call whole in one delta (clients join a call's argument deltas by index)."""
        self._held += out.delta_text
        choices = [{"index": self.index, "delta": {}, "logprobs": lp, "finish_reason": None}] if lp else []
        if out.finished:
            calls = self.tools.calls(self._held, reason)
            delta = {"content": self._held} if calls is None else \
                {"tool_calls": [{"index": k, **call} for k, call in enumerate(calls)]}
            choices += [{"index": self.index, "delta": delta, "logprobs": None, "finish_reason": None},
                        {"index": self.index, "delta": {}, "logprobs": None,
                         "finish_reason": reason if calls is None else "tool_calls"}]
        return choices

    def chunk(self, choices: list, **extra) -> str:
        return sse({"id": self.request_id, "object": f"{self.object}.chunk" if self.chat else self.object,
                    "created": self.created, "model": self.model, "choices": choices, **extra})
