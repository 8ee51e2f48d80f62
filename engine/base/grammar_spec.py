"""A structured-outputs spec's shape and what one grammar may cost (`GrammarBudget`): checked
where a request's sampling parameters are made, before any grammar compiles (sample/structured.py
compiles it; the router bounds its compile time)."""

from __future__ import annotations

import json
from dataclasses import dataclass

KEYS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class GrammarBudget:
    """What one grammar may cost: its spec's size, a JSON schema's nesting, its compile time
    (the router's limit; an engine compiles what passed it), and the compiler's cache."""

    max_spec_bytes: int = 128 << 10
    max_depth: int = 32
    compile_timeout_s: float = 5.0
    cache_bytes: int = 64 << 20


BUDGET = GrammarBudget()


def nesting_depth(value) -> int:
    """How deep JSON containers nest (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        items = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        if items is None:
            continue
        deepest = max(deepest, d)
        stack.extend((x, d + 1) for x in items if isinstance(x, (dict, list)))
    return deepest


def check_spec(spec) -> dict | None:
    """The spec's shape (not its grammar: compile() checks that); raises ValueError."""
    if spec is None:
        return None
    if not isinstance(spec, dict) or len(spec) != 1 or next(iter(spec)) not in KEYS:
        raise ValueError(f"structured_outputs must be one of {{{', '.join(KEYS)}: ...}}, got {spec!r}")
    (key, value), = spec.items()
    ok = {"json": isinstance(value, (dict, str)), "json_object": value is True, "regex": isinstance(value, str),
          "grammar": isinstance(value, str) and bool(value.strip()),
          "choice": isinstance(value, list) and bool(value) and all(isinstance(c, str) and c for c in value)}[key]
    if not ok:
        raise ValueError(f"structured_outputs {key!r} has a value of the wrong kind: {value!r}")
    if key == "json":
        try:
            schema = json.loads(value) if isinstance(value, str) else value
        except (ValueError, RecursionError):
            schema = None  # not JSON: the compiler says why
        if nesting_depth(schema) > BUDGET.max_depth:
            raise ValueError(f"structured_outputs 'json' nests deeper than {BUDGET.max_depth} levels")
    size = len(value.encode()) if isinstance(value, str) else len(json.dumps(value)) if value is not True else 0
    if size > BUDGET.max_spec_bytes:
        raise ValueError(f"structured_outputs {key!r} is {size} bytes; the limit is {BUDGET.max_spec_bytes}")
    return spec
