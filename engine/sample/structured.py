"""Structured output: a grammar constrains every sampled token (vLLM's `structured_outputs`).

    spec     SamplingParams.structured_outputs, one of {"json": schema (dict or JSON text)},
             {"json_object": True} (any JSON object), {"regex": pattern}, {"choice": [strings]},
             {"grammar": EBNF text} (GBNF, rooted at `root`)
    compile  per spec by xgrammar's compiler over this model's vocabulary (cached by spec); a
             spec that does not compile is a ValueError naming structured_outputs
    mask     before sampling, each constrained row's next-token bitmask sets the tokens the
             grammar forbids to -inf (after the request's other adjustments, logits_process.py)
    accept   after sampling, the token advances the request's matcher; once the grammar is
             complete only the request's EOS ids remain, so it ends there
    dead end a row where nothing may be sampled (the grammar needs characters this tokenizer
             cannot spell, or it only allows EOS while min_tokens bans it) samples EOS and the
             engine ends the request with finish_reason "invalid" naming why (dead_ends()). A
             grammar that cannot even begin is refused up front (check()).

Budget (`GrammarBudget`, one home for its limits): a spec over 128 KiB or a JSON schema nested
deeper than 32 levels is refused by name before compiling; the router compiles off its event
loop and refuses a grammar that takes longer than 5 s. The compiler's cache is bounded (64 MiB),
and so is the process: what a compile frees goes back to the OS (give_back_heap()), and a
worker compiles a request's grammar on a thread of its own before the engine thread sees the
request (warm()), so a new grammar never stalls a step.

The matcher is made when the request first samples on this engine, replaying the outputs it
already has: a decode worker gets the first token (sampled under the same grammar on the
prefill worker) with the handoff. Why xgrammar, and the memory and cost measurements:
docs/design/structured.md.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import json
import re
from typing import TYPE_CHECKING

import torch

from ..base.grammar_spec import BUDGET, check_spec

if TYPE_CHECKING:
    from ..core.request import Request

JSON_OBJECT = '{"type": "object"}'
REGEX_SPECIAL = frozenset("\\.^$*+?()[]{}|")


def regex_literal(text: str) -> str:
    """`text` as a regex matching it literally (Python's re.escape also escapes spaces and other
    characters xgrammar's regex reads as unknown escapes, with a warning per character)."""
    return "".join("\\" + c if c in REGEX_SPECIAL else c for c in text)


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: its allocator is left as it is
        return None


def give_back_heap() -> None:
    """Returns the free pages of the C heap to the OS (glibc's malloc_trim; elsewhere nothing).
    A compile's scratch is freed into the arenas of the compiler's threads, which glibc keeps:
    without this, every distinct grammar left some behind for the life of the process."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


class Grammars:
    """The engine's grammars: compiled specs (cached) and one matcher per constrained request."""

    def __init__(self, hf_tokenizer, vocab_size: int):
        """`hf_tokenizer() -> transformers' tokenizer`: called when the first grammar compiles
        (an engine that serves none never loads it)."""
        self.hf_tokenizer, self.vocab_size = hf_tokenizer, vocab_size
        self.matchers: dict[str, object] = {}
        self._dead: dict[str, str] = {}  # request id -> why its grammar allows nothing (dead_ends())

    @functools.cached_property
    def _compiler(self):
        import xgrammar as xgr

        return xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(self.hf_tokenizer(), vocab_size=self.vocab_size),
                                   cache_limit_bytes=BUDGET.cache_bytes)

    @property
    def cache_bytes(self) -> int:
        return self._compiler.get_cache_size_bytes() if "_compiler" in self.__dict__ else 0

    def compile(self, spec: dict):
        check_spec(spec)  # the budget first: size and depth
        (key, value), = spec.items()
        c = self._compiler
        cached = c.get_cache_size_bytes()
        try:
            if key == "json":
                return c.compile_json_schema(value if isinstance(value, str) else json.dumps(value))
            if key == "json_object":  # an object with any members, as OpenAI's response_format means
                return c.compile_json_schema(JSON_OBJECT, strict_mode=False)
            if key == "regex":
                return c.compile_regex(value)
            if key == "grammar":  # EBNF (GBNF), rooted at `root`
                return c.compile_grammar(value)
            return c.compile_regex("(" + "|".join(regex_literal(v) for v in value) + ")")
        except Exception as e:  # noqa: BLE001 - the library's own errors name the problem
            why = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", str(e))  # the library's time and source line
            raise ValueError(f"structured_outputs {key!r} does not compile: {why}") from None
        finally:
            if c.get_cache_size_bytes() != cached:  # a compile, not a cache hit: its scratch goes back
                give_back_heap()

    def warm(self, spec: dict | None) -> None:
        """compile() into the cache, where check() and the request's matcher then find it; safe
        on any thread (a worker calls it off the engine thread, so a new grammar never holds up
        a step). A grammar that does not compile is left for check() to refuse."""
        if spec:
            with contextlib.suppress(ValueError):
                self.compile(spec)

    def check(self, spec: dict) -> None:
        """compile(), and a grammar some token of this vocabulary can begin; else ValueError."""
        import xgrammar as xgr

        matcher = xgr.GrammarMatcher(self.compile(spec))
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(bitmask, 0)
        probe = torch.zeros(1, self.vocab_size)
        xgr.apply_token_bitmask_inplace(probe, bitmask, vocab_size=self.vocab_size)
        if torch.isneginf(probe).all():
            key = next(iter(spec))
            raise ValueError(f"structured_outputs {key!r} cannot be produced: no token of this model's vocabulary "
                             "can begin it (characters its tokenizer cannot spell?)")

    def _matcher(self, req: Request):
        m = self.matchers.get(req.request_id)
        if m is None:
            import xgrammar as xgr

            stops = list(req.eos_token_ids) or None
            m = self.matchers[req.request_id] = xgr.GrammarMatcher(
                self.compile(req.sampling_params.structured_outputs), override_stop_tokens=stops)
            for t in req.output_token_ids:
                m.accept_token(t)
        return m

    def mask(self, logits: torch.Tensor, reqs: list[Request]) -> list[int]:
        """Applies the constrained rows' masks in place; returns the rows that go on (a dead
        end's row is left to sample EOS, and its request is in dead_ends())."""
        rows = [i for i, r in enumerate(reqs) if r.sampling_params.structured_outputs]
        if not rows:
            return rows
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(len(reqs), self.vocab_size)
        for i in rows:
            self._matcher(reqs[i]).fill_next_token_bitmask(bitmask, i)
        dead = [i for i in rows if not self._any_allowed(bitmask[i], reqs[i].banned_token_ids())]
        for i in dead:  # sample EOS (any token would do): the engine ends the request (dead_ends())
            req = reqs[i]
            self._dead[req.request_id] = (
                f"structured_outputs: after {len(req.output_token_ids)} output token(s) the grammar allows no token "
                "(it needs characters this tokenizer cannot spell, or only EOS while min_tokens bans it)")
            bitmask[i].zero_()
            eos = (list(req.eos_token_ids) or [0])[0]
            bitmask[i, eos // 32] = 1 << (eos % 32) if eos % 32 < 31 else -(1 << 31)
            logits[i, eos] = 0.0  # banned (-inf) by min_tokens perhaps: a finite value to sample
        xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                        vocab_size=self.vocab_size, indices=rows)
        return [i for i in rows if i not in dead]

    def _any_allowed(self, row: torch.Tensor, banned: tuple[int, ...]) -> bool:
        """Whether a bitmask row (host int32 words) allows a token outside `banned`, without
        touching the device (a check on the masked logits would sync every step)."""
        if not banned:
            return bool(row.any())
        row = row.clone()
        for t in banned:
            if t < self.vocab_size:
                row[t // 32] &= ~(1 << (t % 32)) if t % 32 < 31 else (1 << 31) - 1
        return bool(row.any())

    def accept(self, reqs: list[Request], rows: list[int], tokens: list[int]) -> None:
        for i in rows:
            if not self._matcher(reqs[i]).accept_token(tokens[i]):  # the mask allowed it: not expected
                self._dead[reqs[i].request_id] = f"structured_outputs: token {tokens[i]} was rejected by the grammar"

    def dead_ends(self, request_id: str) -> str | None:
        """Why the request's grammar came to a dead end this step (taken once), or None."""
        return self._dead.pop(request_id, None)

    def forget(self, request_id: str) -> None:
        self.matchers.pop(request_id, None)
        self._dead.pop(request_id, None)
