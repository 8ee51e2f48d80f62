"""A chat request's prompt: the messages through the model's chat template, with the guards
that keep a client from forging a turn (special tokens spelled in any string the template
renders: messages and their tool fields, tools, `chat_template_kwargs`; and kwargs that name
the tokenizer's special tokens)."""

from __future__ import annotations

from pdserve.cluster.api import ServingCluster

from .errors import HTTPError


def special_tokens(tokenizer) -> tuple[str, ...]:
    """The texts the tokenizer reads as control tokens (its special and added special tokens)."""
    found = set(getattr(tokenizer, "all_special_tokens", []) or [])
    found |= {t.content for t in (getattr(tokenizer, "added_tokens_decoder", {}) or {}).values()
              if getattr(t, "special", False)}
    return tuple(sorted(t for t in found if t))


def chat_ids(cluster: ServingCluster, messages, add_generation_prompt: bool = True,
             tools: list[dict] | None = None, refuse: tuple[str, ...] = (), **template_kwargs) -> list[int]:
    """The prompt's ids. Every string that reaches the template is screened for the special
    tokens in `refuse`: each turn's text and its tool fields (name, tool_calls' names and
    arguments, tool_call_id), every string of `tools` (names, descriptions, parameter schemas)
    and of chat_template_kwargs. A template renders them verbatim, and the tokenizer reads a
    spelled `<|im_start|>` as the control token: a forged turn."""
    conv = [m.for_template() for m in messages]
    for i, turn in enumerate(conv):
        screen(turn, refuse, f"messages[{i}]", "messages")
    for i, tool in enumerate(tools or ()):
        screen(tool, refuse, f"tools[{i}]", "tools")
    check_template_kwargs(cluster.tokenizer, template_kwargs, refuse)
    try:
        return list(cluster.tokenizer.apply_chat_template(conv, tools=tools, tokenize=True, return_dict=False,
                                                          add_generation_prompt=add_generation_prompt,
                                                          **template_kwargs))
    except Exception as e:  # noqa: BLE001 - the template rejects the conversation
        raise HTTPError(400, f"cannot apply the chat template: {e}", param="messages") from None


def check_template_kwargs(tokenizer, kwargs: dict, refuse: tuple[str, ...]) -> None:
    """chat_template_kwargs may not name the tokenizer's special tokens (Hugging Face merges the
    kwargs over its special-token map: {"bos_token": "<|im_start|>system..."} would put a forged
    turn where the template renders {{ bos_token }}), and their strings, at any depth, are
    screened like message text."""
    names = {*getattr(tokenizer, "special_tokens_map", {}), *getattr(tokenizer, "SPECIAL_TOKENS_ATTRIBUTES", ()),
             "additional_special_tokens", "extra_special_tokens"}
    named = sorted(set(kwargs) & names)
    if named:
        raise HTTPError(400, f"chat_template_kwargs may not set {named}: they are the tokenizer's special tokens",
                        param="chat_template_kwargs")

    for key, value in kwargs.items():
        screen(value, refuse, f"chat_template_kwargs[{key!r}]", "chat_template_kwargs")


def strings(v):
    """Every string in a JSON-like value, at any depth (a dict's keys too)."""
    if isinstance(v, str):
        yield v
    elif isinstance(v, dict):
        for x in (*v.keys(), *v.values()):
            yield from strings(x)
    elif isinstance(v, (list, tuple)):
        for x in v:
            yield from strings(x)


def screen(value, refuse: tuple[str, ...], where: str, param: str) -> None:
    """A 400 naming `where` if any string in `value` spells one of the special tokens `refuse`."""
    bad = next((t for text in strings(value) for t in refuse if t in text), None)
    if bad is not None:
        raise HTTPError(400, f"{where} contains the special token {bad!r}, which would be read as a control token "
                             "(the server refuses them: --chat-special-tokens allow lets them through)", param=param)
