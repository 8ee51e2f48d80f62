"""Tokenizer loading and incremental detokenization.

The detokenizer emits text as tokens arrive, holding back a delta while it ends in
an incomplete UTF-8 sequence (U+FFFD), and decodes each new token together with a
few tokens of context so that tokenizers which drop a word's leading space when it
is decoded alone still produce the right text. Streaming and non-streaming outputs
are built from the same deltas, so they are identical.
"""

from __future__ import annotations

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


class IncrementalDetokenizer:
    """A request's text as its tokens come: each push decodes the tokens since the last
    complete piece (a few prompt tokens of left context first), once. Decoding goes straight to
    the Rust tokenizer where transformers' decode would only add its Python wrapping (no
    clean-up of spaces): at batch 64 the wrapped decode, twice per token, was the largest part
    of the host's ~8 ms per engine step on an H100 host (bench/results/overlap/)."""

    CONTEXT = 6  # prompt tokens kept as left context

    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(prompt_token_ids[-self.CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        raw = getattr(tokenizer, "_tokenizer", None)
        direct = raw is not None and hasattr(raw, "decode") and getattr(tokenizer, "clean_up_tokenization_spaces",
                                                                        True) is False
        self._raw = raw if direct else None
        self._prefix: str | None = None  # the decoded ids[prefix_offset:read_offset]

    def _decode(self, ids: list[int]) -> str:
        if self._raw is not None:
            return self._raw.decode(ids, skip_special_tokens=self.skip_special_tokens)
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
