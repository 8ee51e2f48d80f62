"""Tool-call parsers for tool_choice "auto" (vLLM's `--enable-auto-tool-choice
--tool-call-parser NAME`): the reply is free text, and each model family writes a call in its
own format, which the parser finds and takes out of the text.

    hermes       Qwen 2.5, Hermes: <tool_call>{"name": f, "arguments": {...}}</tool_call>, any
                 number, after optional text (the content)
    llama3_json  Llama 3.x: the reply is {"name": f, "parameters": {...}} (or "arguments"),
                 several joined by ";", after an optional <|python_tag|>
    mistral      Mistral: [TOOL_CALLS][{"name": f, "arguments": {...}}, ...] after optional
                 text; the marker is a special token, so the parser also takes a reply that is
                 the bare array

    parse(text)      (content, [(name, arguments)]): no calls when the text holds none that parse
    streamable(text) how much of a streamed reply is surely content (a marker's possible
                     beginning, and everything after a marker, is held until the end)
"""

from __future__ import annotations

import json

Call = tuple[str, dict]


def _json_values(text: str, sep: str = "") -> list | None:
    """The JSON values that make up `text` (separated by whitespace and `sep`), or None."""
    dec, i, out = json.JSONDecoder(), 0, []
    while True:
        while i < len(text) and (text[i].isspace() or text[i] in sep):
            i += 1
        if i == len(text):
            return out
        try:
            value, i = dec.raw_decode(text, i)
        except ValueError:
            return None
        out.append(value)


def _call(obj, args_key: str = "arguments") -> Call | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return (obj["name"], args) if isinstance(args, dict) else None


def _held_tail(text: str, marker: str) -> int:
    """The length of the longest end of `text` that may begin `marker`."""
    return next((k for k in range(min(len(marker) - 1, len(text)), 0, -1) if marker.startswith(text[-k:])), 0)


class ToolParser:
    name = ""
    marker = ""  # what begins a call in the text

    def parse(self, text: str) -> tuple[str | None, list[Call]]:
        raise NotImplementedError

    def streamable(self, text: str) -> int:
        at = text.find(self.marker)
        return at if at >= 0 else len(text) - _held_tail(text, self.marker)


class Hermes(ToolParser):
    name, marker, end = "hermes", "<tool_call>", "</tool_call>"

    def parse(self, text: str) -> tuple[str | None, list[Call]]:
        calls, at = [], text.find(self.marker)
        if at < 0:
            return text, []
        rest = text[at:]
        while rest.startswith(self.marker):
            body, sep, rest = rest[len(self.marker):].partition(self.end)
            values = _json_values(body)
            call = _call(values[0]) if values and len(values) == 1 else None
            if call is None or not sep:  # not a whole call: the reply is text
                return text, []
            calls.append(call)
            rest = rest.lstrip()
        return text[:at].strip() or None, calls


class Llama3JSON(ToolParser):
    name, marker = "llama3_json", "<|python_tag|>"

    def parse(self, text: str) -> tuple[str | None, list[Call]]:
        body = text.strip().removeprefix(self.marker)
        values = _json_values(body, ";") if body.lstrip().startswith("{") else None
        calls = [_call(v, "parameters") for v in values or []]
        if not calls or None in calls:
            return text, []
        return None, calls

    def streamable(self, text: str) -> int:
        head = text.lstrip()
        if not head or head.startswith(("{", self.marker)) or self.marker.startswith(head):
            return 0  # the reply may be a call: hold it
        return len(text)


class Mistral(ToolParser):
    name, marker = "mistral", "[TOOL_CALLS]"

    def parse(self, text: str) -> tuple[str | None, list[Call]]:
        at = text.find(self.marker)
        head, body = (text[:at], text[at + len(self.marker):]) if at >= 0 else ("", text)
        if at < 0 and not body.lstrip().startswith("[{"):
            return text, []
        values = _json_values(body)
        items = values[0] if values and len(values) == 1 and isinstance(values[0], list) else None
        calls = [_call(v) for v in items or []]
        if not calls or None in calls:
            return text, []
        return head.strip() or None, calls

    def streamable(self, text: str) -> int:
        if text.lstrip().startswith("[") or not text.strip():
            return 0  # the bare array (the marker token skipped from the text)
        return super().streamable(text)


PARSERS = {p.name: p for p in (Hermes(), Llama3JSON(), Mistral())}
