"""Tool calling for chat completions, through the grammar (engine/sample/structured.py), not a parser:

    tool_choice={"type": "function", "function": {"name": f}}
                 the reply is constrained to f's `parameters` JSON schema; it becomes one
                 tool call to f (finish_reason "tool_calls")
    tool_choice="required"
                 the reply is constrained to a JSON array of {"name", "arguments"} objects, one
                 of the tools each (parallel_tool_calls=false: exactly one); it becomes those
                 tool calls
    tool_choice="none"
                 the tools go to the chat template only; the reply is text
    tool_choice="auto" (OpenAI's default once tools are given)
                 with the server's --enable-auto-tool-choice --tool-call-parser NAME: the reply
                 is free text; the parser (tool_parsers.py) takes the model family's calls out
                 of it (streamed: content goes out until a call may begin, the calls at the
                 end); without a parser, a 400 naming tool_choice

The tools are given to the chat template in every case (as vLLM does), and earlier turns'
`tool_calls` and `tool` messages go to it as they came. A reply cut short by max_tokens
(finish_reason "length") is neither: with tool_choice named or "required", no tool_calls and empty
content (the grammar's partial JSON is not an answer, as OpenAI and vLLM return it); with
"auto", the text as content.
"""

from __future__ import annotations

import json
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from pdserve.engine.sampling_params import InvalidParam

from .tool_parsers import PARSERS, ToolParser


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None  # a JSON schema; none: any JSON object
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ToolCalls:
    """One request's tool mode: its grammar (spec()) and its reply as calls (calls())."""

    def __init__(self, tools: list[Tool], choice: ToolChoice | None, parallel: bool,
                 parser: ToolParser | None = None):
        self.auto = parser if choice in (None, "auto") else None  # the reply is text the parser reads
        self.schemas = {t.function.name: t.function.parameters or {"type": "object"} for t in tools}
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in self.schemas:
                raise InvalidParam("tool_choice", f"names {choice.function.name!r}, which is not one of the tools "
                                 f"{sorted(self.schemas)}")
            self.named: str | None = choice.function.name
        else:
            self.named = None
        self.parallel = parallel

    @classmethod
    def of(cls, tools: list[Tool] | None, choice: ToolChoice | None, parallel: bool,
           parser: ToolParser | None = None) -> ToolCalls | None:
        """The request's tool mode, None when its reply is plain text; raises InvalidParam
        naming tool_choice. `parser`: the server's (tool_choice auto)."""
        if not tools:
            if choice not in (None, "none"):
                raise InvalidParam("tool_choice", "needs tools")
            return None
        if (choice is None or choice == "auto") and parser is None:
            raise InvalidParam("tool_choice", "'auto' (the default when tools are given) needs the server started with "
                             "--enable-auto-tool-choice --tool-call-parser NAME (the model's call format: "
                             f"{', '.join(PARSERS)}); or give tool_choice 'required', a named function, or 'none'")
        return None if choice == "none" else cls(tools, choice, parallel, parser)

    def spec(self) -> dict:
        """structured_outputs for the reply. A tool's schema nests under the array's
        `anyOf`, so its root-relative references (`#/$defs/X`, what pydantic's
        model_json_schema() emits for nested models, and `#` itself) are moved to the root's
        `$defs` under the tool's name (nested_schema()). None for auto: the reply is free."""
        if self.auto is not None:
            return None
        if self.named is not None:
            return {"json": self.schemas[self.named]}
        defs, one = {}, []
        for name, schema in self.schemas.items():
            body, own = nested_schema(schema, f"{name}.")
            defs.update(own)
            one.append({"type": "object", "properties": {"name": {"const": name}, "arguments": body},
                        "required": ["name", "arguments"], "additionalProperties": False})
        return {"json": {"type": "array", "items": {"anyOf": one}, "minItems": 1,
                         **({} if self.parallel else {"maxItems": 1}), **({"$defs": defs} if defs else {})}}

    def reply(self, text: str, finish_reason: str | None) -> tuple[str | None, list[dict] | None]:
        """A finished reply as (content, OpenAI's tool_calls or None). Auto: the parser's calls
        to known tools (the first only without parallel_tool_calls) and the text around them."""
        if self.auto is None:
            if finish_reason == "length":  # a call cut short is no call, and its JSON no content
                return "", None
            calls = self.calls(text, finish_reason)
            return (text, None) if calls is None else (None, calls)
        content, pairs = self.auto.parse(text) if finish_reason == "stop" else (text, [])
        pairs = [(n, a) for n, a in pairs if n in self.schemas][:None if self.parallel else 1]
        return (content, self._openai(pairs)) if pairs else (text, None)

    def streamable(self, text: str) -> int:
        """How much of a streamed reply may go out as content now (tool mode holds the rest)."""
        return self.auto.streamable(text) if self.auto is not None else 0

    @staticmethod
    def _openai(pairs: list[tuple[str, dict]]) -> list[dict]:
        return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                 "function": {"name": name, "arguments": json.dumps(args)}} for name, args in pairs]

    def calls(self, text: str, finish_reason: str | None) -> list[dict] | None:
        """OpenAI's tool_calls of a finished constrained reply; None when it is not a whole
        call (length)."""
        if finish_reason != "stop":
            return None
        try:  # the grammar's whole output parses; a stop string may have cut it
            value = json.loads(text)
            pairs = [(self.named, value)] if self.named is not None else [(c["name"], c["arguments"]) for c in value]
        except (json.JSONDecodeError, TypeError, KeyError):
            return None
        return self._openai(pairs)


DEF_KEYS = ("$defs", "definitions")


def nested_schema(schema: dict, prefix: str) -> tuple[dict, dict]:
    """A schema to be placed below another's root: (its body, the definitions to add to the
    new root's $defs). Its own `$defs` / `definitions` move out under `prefix` + name, and
    every `$ref` to them (or to `#`, its root, kept as prefix + "root") is rewritten."""
    renamed = {f"#/{k}/{name}": f"#/$defs/{prefix}{name}" for k in DEF_KEYS for name in schema.get(k, {}) or {}}
    refers_to_root = False

    def walk(node):
        nonlocal refers_to_root
        if isinstance(node, list):
            return [walk(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = {}
        for k, v in node.items():
            if k == "$ref" and isinstance(v, str):
                if v == "#":
                    refers_to_root, v = True, f"#/$defs/{prefix}root"
                else:
                    head = next((r for r in renamed if v == r or v.startswith(r + "/")), None)
                    v = renamed[head] + v[len(head):] if head else v
            out[k] = walk(v)
        return out

    body = walk({k: v for k, v in schema.items() if k not in DEF_KEYS})
    defs = {f"{prefix}{name}": walk(d) for k in DEF_KEYS for name, d in (schema.get(k) or {}).items()}
    if refers_to_root:
        defs[f"{prefix}root"] = body
    return body, defs
