"""vLLM's tokenizer routes: /tokenize (a prompt, or chat messages through the template with
a chat completion's options), /detokenize and /tokenizer_info."""

from __future__ import annotations

from fastapi import FastAPI, Request

from pdserve.cluster.api import ServingCluster

from .chat import chat_ids
from .errors import HTTPError
from .runner import RequestRunner
from .schemas import DetokenizeRequest, TokenizeRequest


def check_model_name(req, cluster: ServingCluster, model_name: str) -> None:
    if req.model not in (None, model_name, cluster.model_path):
        raise HTTPError(404, f"model {req.model!r} does not exist; this server serves {model_name!r}",
                        param="model")


def add_token_routes(app: FastAPI, cluster: ServingCluster, runner: RequestRunner, model_name: str) -> None:
    """vLLM's /tokenize and /detokenize."""

    @app.post("/tokenize")
    async def tokenize(request: Request):
        """vLLM's: {"prompt": text} or {"messages": [...]} -> {"count", "max_model_len", "tokens"}."""
        req = await runner.parse(request, TokenizeRequest)
        check_model_name(req, cluster, model_name)
        if (req.prompt is None) == (req.messages is None):
            raise HTTPError(400, "give exactly one of 'prompt' and 'messages'", param="prompt")
        tok = cluster.tokenizer
        if req.prompt is not None:
            ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            ids = chat_ids(cluster, req.messages, tools=[t.model_dump(exclude_none=True) for t in req.tools or []]
                           or None, refuse=runner.chat_specials, **req.template_kwargs())
        strs = tok.convert_ids_to_tokens(list(ids)) if req.return_token_strs else None  # null unasked, as vLLM
        return {"count": len(ids), "max_model_len": cluster.max_model_len, "tokens": list(ids), "token_strs": strs}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        """vLLM's: the tokenizer's class, its configuration and chat template (what a client
        needs to tokenize as the server does)."""
        return tokenizer_facts(cluster.tokenizer)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        req = await runner.parse(request, DetokenizeRequest)
        check_model_name(req, cluster, model_name)
        vocab = len(cluster.tokenizer)
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise HTTPError(400, f"token id {bad} is outside the vocabulary (0..{vocab - 1})", param="tokens")
        return {"prompt": cluster.tokenizer.decode(req.tokens)}


def tokenizer_facts(tok) -> dict:
    """The tokenizer's init settings that JSON can carry (special tokens as their text)."""
    def plain(v):
        if v is None or isinstance(v, (str, int, float, bool)):
            return v
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {str(k): plain(x) for k, x in v.items()}
        return str(v)  # an AddedToken: its text

    skip = {"added_tokens_decoder", "name_or_path", "tokenizer_file", "vocab_file", "merges_file"}
    conf = {k: plain(v) for k, v in getattr(tok, "init_kwargs", {}).items() if k not in skip}
    return {**conf, "tokenizer_class": type(tok).__name__, "chat_template": getattr(tok, "chat_template", None),
            "vocab_size": len(tok), "model_max_length": plain(getattr(tok, "model_max_length", None))}
