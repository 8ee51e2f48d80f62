"""Per-token cost of a structured-output mask: xgrammar vs llguidance on the default model's
tokenizer, for a JSON schema and for any JSON (json_object). A walk feeds the tokens of a
valid document; each step fills the next-token bitmask (timed) and checks that the document's
next token is allowed. CPU (the mask is computed on the host in both libraries).

    python bench/grammar_mask.py            # table last; writes bench/results/grammar/
"""

from __future__ import annotations

import json
import os
import statistics
import time

import torch

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}}, "admin": {"type": "boolean"}},
    "required": ["name", "age", "tags", "admin"], "additionalProperties": False}
DOC = json.dumps({"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines", "poetry"], "admin": True})


def walk_xgrammar(tok, vocab: int, schema: dict | None) -> tuple[float, list[float]]:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info)
    cg = compiler.compile_json_schema(json.dumps(schema)) if schema else compiler.compile_builtin_json_grammar()
    compile_s = time.perf_counter() - t0
    m = xgr.GrammarMatcher(cg)
    bm = xgr.allocate_token_bitmask(1, vocab)
    times = []
    for t in tok.encode(DOC, add_special_tokens=False):
        t1 = time.perf_counter()
        m.fill_next_token_bitmask(bm)
        times.append(time.perf_counter() - t1)
        assert (bm[0, t // 32] >> (t % 32)) & 1, "the document's token is masked"
        assert m.accept_token(t)
    return compile_s, times


def walk_llguidance(tok, vocab: int, schema: dict | None) -> tuple[float, list[float]]:
    import llguidance
    import llguidance.hf
    from llguidance.torch import allocate_token_bitmask, fill_next_token_bitmask

    t0 = time.perf_counter()
    ltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    grm = llguidance.LLMatcher.grammar_from_json_schema(schema if schema else {"type": "object"})
    m = llguidance.LLMatcher(ltok, grm)
    compile_s = time.perf_counter() - t0
    bm = allocate_token_bitmask(1, vocab)
    times = []
    for t in tok.encode(DOC, add_special_tokens=False):
        t1 = time.perf_counter()
        fill_next_token_bitmask(m, bm, 0)
        times.append(time.perf_counter() - t1)
        assert (bm[0, t // 32] >> (t % 32)) & 1, "the document's token is masked"
        assert m.consume_token(t), m.get_error()
    return compile_s, times


def main() -> None:
    from pdserve.engine.exec.loader import resolve_model_path
    from pdserve.engine.tokenizer import load_tokenizer

    torch.set_num_threads(1)
    tok = load_tokenizer(resolve_model_path(None))
    vocab = len(tok)
    rows = []
    for lib, walk in (("xgrammar", walk_xgrammar), ("llguidance", walk_llguidance)):
        for kind, schema in (("json_schema", SCHEMA), ("json_object", None)):
            walk(tok, vocab, schema)  # warm (caches)
            compile_s, times = walk(tok, vocab, schema)
            rows.append({"library": lib, "grammar": kind, "compile_ms": 1e3 * compile_s, "tokens": len(times),
                         "mask_us_median": 1e6 * statistics.median(times), "mask_us_p99": 1e6 * max(times)})
    out = "bench/results/grammar"
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "grammar_mask.json"), "w") as f:
        json.dump({"vocab": vocab, "document_tokens": rows[0]["tokens"], "rows": rows}, f, indent=2)
    lines = [f"# Structured-output mask per token (CPU, one thread, vocabulary {vocab})", "",
             "| library | grammar | compile (ms, warm) | mask per token, median (us) | max (us) |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['library']} | {r['grammar']} | {r['compile_ms']:.1f} | {r['mask_us_median']:.0f} | "
              f"{r['mask_us_p99']:.0f} |" for r in rows]
    with open(os.path.join(out, "grammar_mask.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
