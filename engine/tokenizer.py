"""Tokenizer loading and incremental detokenization.

The detokenizer emits text as tokens arrive, holding back a delta while it ends in
an incomplete UTF-8 sequence (U+FFFD), and decodes each new token together with a
few tokens of context so that tokenizers which drop a word's leading space when it
is decoded alone still produce the right text. Streaming and non-streaming outputs
are built from the same deltas, so they are identical.
"""

from __future__ import annotations

import functools
import os

# silence the tokenizers fork warning in worker processes
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
# the files one of which a model directory's tokenizer is read from (Hugging Face's fast, BPE,
# WordPiece and SentencePiece forms)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model")


_LOADED: dict[tuple, object] = {}  # load_tokenizer's: (directory, its files' sizes and times) -> tokenizer


def load_tokenizer(path: str):
    """The model's tokenizer, loaded once per process for a directory whose files are unchanged
    (each engine of a process, the in-process LLM's and the tests' many, shares it: it is read,
    never changed, and loading one costs ~0.4 s of CPU). A directory whose tokenizer_config.json names the generic fast
    class (with a tokenizer.json) loads it directly: AutoTokenizer imports the auto mappings
    and the model's config class first, 5.0 s against 1.0 s in a fresh process on 2 cores,
    and every worker, CLI call and test process pays it; the tokenizer is the same object.
    Any other class goes through AutoTokenizer. A directory with none of TOKENIZER_FILES, or
    whose tokenizer turns text into no tokens, is refused naming what is missing (a model saved
    with save_pretrained alone loaded an empty tokenizer, and every prompt was then empty)."""
    if os.path.isdir(path) and not any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES):
        raise ValueError(f"{path} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}): save the "
                         "tokenizer beside the model: tokenizer.save_pretrained(DIR)")
    key = _files_key(path)
    if key is not None and key in _LOADED:
        return _LOADED[key]
    try:
        if _generic(path):
            from transformers import PreTrainedTokenizerFast

            tok = PreTrainedTokenizerFast.from_pretrained(path)
        else:
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - re-raised with the path named
        raise ValueError(f"could not load a tokenizer from {path!r}: {e}") from e
    if not tok.encode("hello world", add_special_tokens=False):
        raise ValueError(f"the tokenizer of {path} turns text into no tokens: its files are incomplete")
    if key is not None:
        _LOADED[key] = tok
    return tok


def _files_key(path: str) -> tuple | None:
    """A directory's identity for load_tokenizer's cache: its real path and each file's name, size
    and modification time (None: not a directory, nothing to cache)."""
    if not os.path.isdir(path):
        return None
    real = os.path.realpath(path)
    try:
        files = tuple(sorted((e.name, e.stat().st_size, e.stat().st_mtime_ns) for e in os.scandir(real) if e.is_file()))
    except OSError:
        return None
    return real, files


def _generic(path: str) -> bool:
    import json

    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            cls = json.load(f).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return False
    return cls in GENERIC_CLASSES and os.path.exists(os.path.join(path, "tokenizer.json"))


class ModelTokenizer:
    """The model's tokenizer as an engine uses it: `encode`, `decode` and `eos_token_id`, and
    transformers' own tokenizer as `hf` (chat templates, grammars), loaded on first use.

    A directory whose tokenizer is transformers' generic fast class over a tokenizer.json that
    transformers would use as it is (`_rust_as_is`) is read with the `tokenizers` library alone:
    the class adds only Python wrapping around the same Rust tokenizer for these calls, and
    importing transformers cost each worker process 1.1 s of CPU on 2 cores (a CI run starts
    ~230). Any other directory goes through transformers for everything."""

    def __init__(self, path: str):
        self.path = path
        self._rust = _rust_as_is(path)
        if self._rust is None:
            self.hf = load_tokenizer(path)  # checks the directory; the instance's own attribute from now on
            self.eos_token_id = self.hf.eos_token_id
            self.clean_up_tokenization_spaces = self.hf.clean_up_tokenization_spaces
        else:
            eos = _config(path)[1]
            self.eos_token_id = self._rust.token_to_id(eos) if eos else None
            self.clean_up_tokenization_spaces = False
            if not self.encode("hello world", add_special_tokens=False):
                raise ValueError(f"the tokenizer of {path} turns text into no tokens: its files are incomplete")

    @functools.cached_property
    def hf(self):
        """transformers' tokenizer of the same directory (loaded once per process)."""
        return load_tokenizer(self.path)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._rust is None:
            return self.hf.encode(text, add_special_tokens=add_special_tokens)
        return self._rust.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """The text of `ids`: straight through the Rust tokenizer wherever transformers' decode
        would not clean up spaces (it would only add its Python wrapping: at batch 64 the wrapped
        decode, twice per token, was the largest part of the host's ~8 ms per engine step on an
        H100 host, bench/results/overlap/)."""
        raw = self._rust if self._rust is not None else getattr(self.hf, "_tokenizer", None)
        if raw is not None and hasattr(raw, "decode") and self.clean_up_tokenization_spaces is False:
            return raw.decode(ids, skip_special_tokens=skip_special_tokens)
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)


_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


def _config(path: str) -> tuple[dict, str | None]:
    """tokenizer_config.json's fields ({} where it cannot be read) and its eos token's text."""
    import json

    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return {}, None
    cfg = cfg if isinstance(cfg, dict) else {}
    eos = cfg.get("eos_token")
    return cfg, eos.get("content") if isinstance(eos, dict) else eos


def _rust_as_is(path: str):
    """The directory's tokenizer.json as a `tokenizers.Tokenizer`, where transformers' generic
    fast class would use that file unchanged; else None. It changes it where the config asks for
    BOS/EOS templates (add_bos_token, add_eos_token) or the file has no post-processor (it builds
    one), where a special token the config names is not a special token of the file (it adds
    it), where the vocabulary exceeds 100,000 (its Mistral regex patch), and where it cleans up
    spaces or splits special tokens on decode or encode."""
    if not _generic(path):
        return None
    key = _files_key(path)
    if key is not None and ("rust", key) in _LOADED:
        return _LOADED[("rust", key)]
    cfg, _ = _config(path)
    if {"add_bos_token", "add_eos_token", "added_tokens_decoder", "extra_special_tokens",
            "additional_special_tokens"} & cfg.keys() or cfg.get("clean_up_tokenization_spaces") \
            or cfg.get("split_special_tokens"):
        return None
    try:
        from tokenizers import Tokenizer

        rust = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    except Exception:  # noqa: BLE001 - transformers then reads it, and names the problem
        return None
    specials = {t.content for t in rust.get_added_tokens_decoder().values() if t.special}
    named = [v.get("content") if isinstance(v, dict) else v for k in _SPECIAL_KEYS if (v := cfg.get(k)) is not None]
    if rust.post_processor is None or rust.truncation or rust.padding or rust.get_vocab_size() > 100_000 \
            or not set(named) <= specials:
        return None
    if key is not None:
        _LOADED[("rust", key)] = rust  # read, never changed: every engine of the process shares it
    return rust


class IncrementalDetokenizer:
    """A request's text as its tokens come: each push decodes the tokens since the last
    complete piece (a few prompt tokens of left context first), once, with the engine's
    ModelTokenizer (straight to the Rust tokenizer where that gives transformers' text)."""

    CONTEXT = 6  # prompt tokens kept as left context

    def __init__(self, tokenizer: ModelTokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_token_ids[-self.CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self._prefix: str | None = None  # the decoded ids[prefix_offset:read_offset]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Adds one token and returns the new text it completes (maybe empty)."""
        self.ids.append(token_id)
        if self._prefix is None:
            self._prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        prefix = self._prefix
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self._prefix = None
            return full[len(prefix):]
        return ""
