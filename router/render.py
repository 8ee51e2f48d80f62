"""OpenAI response bodies for both endpoints, from pdserve outputs: one renderer with
the two shapes (text completion / chat completion) as data, not as twin handlers.

    final(out, n_prompt)   the non-streaming body of a finished (cumulative) output
    opening()              chat's first SSE chunk (the assistant role), None for text
    choices(out)           the SSE choices of one delta output (empty when it adds nothing)
    chunk(choices, ...)    one SSE event
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from pdserve.engine.outputs import RequestOutput


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

    @property
    def object(self) -> str:
        return "chat.completion" if self.chat else "text_completion"

    def final(self, out: RequestOutput, n_prompt: int) -> dict:
        c = out.outputs[0]
        choice = {"index": 0, "logprobs": None, "finish_reason": c.finish_reason}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": c.text}
        else:
            choice["text"] = c.text
        return {"id": self.request_id, "object": self.object, "created": self.created, "model": self.model,
                "choices": [choice], "usage": usage(n_prompt, len(c.token_ids))}

    def opening(self) -> dict | None:
        if not self.chat:
            return None
        return {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}

    def choices(self, out: RequestOutput) -> list[dict]:
        reason = out.outputs[0].finish_reason if out.finished else None
        if not self.chat:
            if not (out.delta_text or out.finished):
                return []
            return [{"index": 0, "text": out.delta_text, "logprobs": None, "finish_reason": reason}]
        choices = [{"index": 0, "delta": {"content": out.delta_text}, "logprobs": None, "finish_reason": None}
                   ] if out.delta_text else []
        if out.finished:
            choices.append({"index": 0, "delta": {}, "logprobs": None, "finish_reason": reason})
        return choices

    def chunk(self, choices: list, **extra) -> str:
        return sse({"id": self.request_id, "object": f"{self.object}.chunk" if self.chat else self.object,
                    "created": self.created, "model": self.model, "choices": choices, **extra})
