"""OpenAI request bodies (the fields pdserve honours; anything else is refused, see NOT_YET and
HINTS) and the error object."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from pdserve.engine.sampling_params import MAX_LOGPROBS, MAX_N, SEED_MAX, SEED_MIN, InvalidParam, SamplingParams

from .tool_parsers import ToolParser
from .tools import Tool, ToolCalls, ToolChoice


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage on every chunk


# OpenAI parameters pdserve does not implement yet: refused (400 naming the parameter) unless
# the value is one that asks for nothing (the default)
NOT_YET = {"best_of": (None, 1), "suffix": (None, ""), "functions": (None, []), "function_call": (None, "none")}
# optional hints the OpenAI API defines that change nothing a server computes: accepted, unused
HINTS = ("user", "metadata", "store", "service_tier")


def screen(data: dict) -> dict:
    """The body without the hints and the defaulted NOT_YET parameters; raises ValueError
    (message, param) for a NOT_YET parameter that asks for something. Any other unknown
    field is then refused by the models (extra="forbid")."""
    for name, allowed in NOT_YET.items():
        if name in data and data[name] not in allowed:
            raise ValueError(f"parameter {name!r} is not supported by this server yet", name)
    return {k: v for k, v in data.items() if k not in NOT_YET and k not in HINTS}


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


NonEmpty = Annotated[str, Field(min_length=1)]
TokenId = Annotated[int, Field(ge=0)]


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs` request field: one of json / regex / choice / grammar /
    json_object."""
    model_config = ConfigDict(extra="forbid")
    json_: dict | str | None = Field(None, alias="json")
    regex: NonEmpty | None = None
    choice: Annotated[list[NonEmpty], Field(min_length=1)] | None = None
    grammar: NonEmpty | None = None
    json_object: bool | None = None

    def spec(self) -> dict:
        given = {k: v for k, v in (("json", self.json_), ("regex", self.regex), ("choice", self.choice),
                                   ("grammar", self.grammar)) if v is not None}
        if self.json_object:
            given["json_object"] = True
        if len(given) != 1:
            raise InvalidParam("structured_outputs", "give exactly one of json, regex, choice, grammar, "
                                                     f"json_object; got {sorted(given) or 'none'}")
        return given


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # the ranges SamplingParams enforces, declared here too so the OpenAPI schema says them
    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)  # 0: completions with echo only (the prompt, scored)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1)
    n: int = Field(1, ge=1, le=MAX_N)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: NonEmpty | list[NonEmpty] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, ge=0.01, le=10)
    min_p: float = Field(0.0, ge=0, le=1)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None  # keys: SamplingParams
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's, the same as response_format's
    guided_json: dict | str | None = None  # vLLM's older names of the same
    guided_regex: str | None = None
    guided_choice: Annotated[list[NonEmpty], Field(min_length=1)] | None = None
    guided_grammar: NonEmpty | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extras
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # the prompt's, in the response
    return_token_ids: bool = False  # the prompt's and each choice's token ids, in the response
    logprob_token_ids: Annotated[list[TokenId], Field(min_length=1, max_length=MAX_LOGPROBS)] | None = None
    return_tokens_as_token_ids: bool | None = None  # log-probs name tokens "token_id:<id>"
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # keep the prompt's last k tokens (-1: max_model_len)
    kv_transfer_params: dict[str, Any] | None = None  # a PD proxy's: accepted; the reply carries pdserve's
    # lower is served first under --scheduling-policy priority (ignored under fcfs)
    priority: StrictInt = Field(0, ge=SEED_MIN, le=SEED_MAX)

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def structured(self, tool_parser: ToolParser | None = None) -> dict | None:
        """structured_outputs (engine/sample/structured.py) from response_format, vLLM's
        structured_outputs or its older guided_* (a chat request's tools too, through `tool_parser`)."""
        given = {k: v for k, v in (("json", self.guided_json), ("regex", self.guided_regex),
                                   ("choice", self.guided_choice), ("grammar", self.guided_grammar)) if v is not None}
        if self.structured_outputs is not None:
            given.update(self.structured_outputs.spec())
        rf = self.response_format
        if rf is not None and rf.type != "text":
            given["response_format"] = True
        if len(given) > 1:
            raise InvalidParam("response_format", f"give one constraint, got {sorted(given)}")
        if rf is not None and rf.type == "json_object":
            return {"json_object": True}
        if rf is not None and rf.type == "json_schema":
            if rf.json_schema is None:
                raise InvalidParam("response_format", "type 'json_schema' needs 'json_schema': {'name', 'schema'}")
            return {"json": rf.json_schema.schema_ or {"type": "object"}}
        return dict(given) or None

    def num_logprobs(self) -> int | None:
        return None

    def asked_logprobs(self) -> int | None:
        """The top N per token; logprob_token_ids alone asks for the sampled token's and theirs."""
        n = self.num_logprobs()
        return 0 if n is None and self.logprob_token_ids else n

    def truncated(self, ids: list[int], max_model_len: int) -> list[int]:
        """The prompt after truncate_prompt_tokens (vLLM's: its last k tokens, -1 for
        max_model_len's worth); raises InvalidParam when k is 0 or past max_model_len."""
        k = self.truncate_prompt_tokens
        if k is None:
            return ids
        if k == 0 or k > max_model_len:
            raise InvalidParam("truncate_prompt_tokens", f"must be -1 or in [1, {max_model_len}] (max_model_len), "
                                                         f"got {k}")
        k = max_model_len if k == -1 else k
        return ids[-k:]

    def num_prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    def sampling_params(self, default_max_tokens: int | None, tool_parser: ToolParser | None = None) -> SamplingParams:
        """Raises InvalidParam naming the bad field. `tool_parser`: the server's, for a chat
        request's tool_choice auto (None: refused)."""
        return SamplingParams(n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              seed=self.seed,
                              max_tokens=self.max_tokens if self.max_tokens is not None else default_max_tokens,
                              min_tokens=self.min_tokens, stop=self.stop, stop_token_ids=self.stop_token_ids,
                              ignore_eos=self.ignore_eos, presence_penalty=self.presence_penalty,
                              frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
                              min_p=self.min_p, logit_bias=self.logit_bias, logprobs=self.asked_logprobs(),
                              logprob_token_ids=self.logprob_token_ids,
                              prompt_logprobs=self.num_prompt_logprobs(), allowed_token_ids=self.allowed_token_ids,
                              structured_outputs=self.structured(tool_parser), priority=self.priority)


class CompletionRequest(_Sampling):
    # token ids as any ints, of any count: an empty or out-of-vocabulary prompt is refused by the one
    # check of a prompt (engine/validation.py: "prompt is empty", "... out of vocabulary (vocabulary
    # size N ...)"), not by pydantic's union, whose first branch's words ("a valid string") misled
    prompt: NonEmpty | list[int] | Annotated[list[NonEmpty], Field(min_length=1)] \
        | Annotated[list[list[int]], Field(min_length=1)]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # the top N per token (and the sampled token's)
    echo: bool = False

    @property
    def scores_only(self) -> bool:
        """max_tokens 0 with echo: the prompt alone, with its log-probs (the legacy API's way to
        score text). One token is generated and dropped."""
        return self.max_tokens == 0

    def sampling_params(self, default_max_tokens: int | None, tool_parser: ToolParser | None = None) -> SamplingParams:
        if not self.scores_only:
            return super().sampling_params(default_max_tokens)
        if not self.echo:
            raise InvalidParam("max_tokens", "must be >= 1 (0 only with echo: the prompt alone, scored)")
        return _Sampling.sampling_params(self.model_copy(update={"max_tokens": 1}), default_max_tokens)

    def num_logprobs(self) -> int | None:
        return self.logprobs

    def num_prompt_logprobs(self) -> int | None:
        """echo with logprobs scores the echoed prompt too (the legacy API's way to score text)."""
        asked = [n for n in (self.prompt_logprobs, self.logprobs if self.echo else None) if n is not None]
        return max(asked) if asked else None


ROLES = ("system", "developer", "user", "assistant", "tool", "function")
# apply_chat_template's arguments that the request sets itself
TEMPLATE_ARGS = frozenset({"conversation", "tools", "tokenize", "return_dict", "add_generation_prompt",
                           "continue_final_message", "documents", "return_tensors", "padding", "truncation",
                           "max_length", "chat_template", "tokenizer_kwargs", "return_assistant_tokens_mask"})


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal[ROLES]  # a template renders the role verbatim: any string could forge a turn
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls (tools.py)
    tool_call_id: str | None = None  # a "tool" turn: the call it answers

    def for_template(self) -> dict:
        """The turn as chat templates take it (the tool fields only where given)."""
        turn = {"role": self.role, "content": self.text()}
        turn.update({k: v for k, v in (("name", self.name), ("tool_calls", self.tool_calls),
                                       ("tool_call_id", self.tool_call_id)) if v is not None})
        return turn

    def text(self) -> str:
        if isinstance(self.content, list):  # [{"type": "text", "text": ...}, ...]
            return "".join(part.get("text", "") for part in self.content if part.get("type") == "text")
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    # vLLM's chat extras
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false}
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the reply goes on from the last (assistant) message
    echo: bool = False  # the reply begins with the last message's text when it is the assistant's

    @model_validator(mode="after")
    def _one_way_to_end_the_prompt(self):
        return check_chat_template_fields(self)

    def template_kwargs(self) -> dict:
        return template_kwargs(self)

    def tool_calls(self, tool_parser: ToolParser | None) -> ToolCalls | None:
        """The request's tool mode (tools.py), `tool_parser` serving tool_choice auto (None:
        refused); raises InvalidParam naming tool_choice."""
        return ToolCalls.of(self.tools, self.tool_choice, self.parallel_tool_calls, tool_parser)

    def structured(self, tool_parser: ToolParser | None = None) -> dict | None:
        calls, other = self.tool_calls(tool_parser), super().structured()
        if calls is not None and calls.auto is not None:
            return other  # the reply is free text (a grammar the request gives still holds)
        if calls is not None and other is not None:
            raise InvalidParam("tool_choice", "a tool call's grammar and response_format / guided_* are two "
                                              "constraints")
        return calls.spec() if calls is not None else other

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidParam("logprobs", "must be true when top_logprobs is set")
        return (self.top_logprobs or 0) if self.logprobs else None


def check_chat_template_fields(req):
    """The chat fields that end the prompt agree, and chat_template_kwargs sets none of the
    request's own (a chat completion's and /tokenize's)."""
    if req.messages and req.continue_final_message:
        if req.add_generation_prompt:
            raise ValueError("continue_final_message: set add_generation_prompt to false with it")
        if req.messages[-1].role != "assistant":
            raise ValueError("continue_final_message needs the last message to be the assistant's")
    reserved = set(req.chat_template_kwargs or {}) & TEMPLATE_ARGS
    if reserved:
        raise ValueError(f"chat_template_kwargs may not set {sorted(reserved)} (the request's own fields)")
    return req


def template_kwargs(req) -> dict:
    return {"add_generation_prompt": req.add_generation_prompt,
            "continue_final_message": req.continue_final_message, **(req.chat_template_kwargs or {})}


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages through the chat template (with the chat
    options a chat completion takes)."""
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    return_token_strs: bool = False  # the tokens' strings too, as the tokenizer spells them

    @model_validator(mode="after")
    def _one_way_to_end_the_prompt(self):
        return check_chat_template_fields(self)

    def template_kwargs(self) -> dict:
        return template_kwargs(self)


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    tokens: list[TokenId]


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
