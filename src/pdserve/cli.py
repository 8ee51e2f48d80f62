"""The `pdserve` command line (the top layer: it may import every package).

    pdserve generate "prompt" [--model DIR] [--max-tokens N] [--temperature T] ...
    pdserve serve [--model M] [--prefill N] [--decode M] [--host 127.0.0.1] [--port 8000] ...
                  [--config serving.yaml] [--autoscale] [--min-decode 1 --max-decode 8] ...
    pdserve status [--url http://127.0.0.1:8000]
    pdserve scale --prefill N --decode M [--url http://127.0.0.1:8000]
    pdserve bench [--url ...] [--workload trace|synthetic|shared-prefix] [--rates 1,2,4] ...
    pdserve profile [--model DIR] --out profile.json      one engine's step costs (capacity planning)
    pdserve simulate --profile P --system hybrid:1:1 -- BENCH ARGS   a bench sweep predicted
    pdserve join HEAD:6379                       a worker host's Ray, until the head's stops

Subcommands import Ray, FastAPI and uvicorn lazily, so `pdserve generate` runs with
the engine alone.
"""

from __future__ import annotations

import argparse
import sys

from pdserve.cli_common import CliError, Parser, add_engine_args, check_kv_dirs, engine_kwargs, in_flags


def cmd_generate(args: argparse.Namespace) -> int:
    from pdserve import LLM, SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed, stop=args.stop or None)
    check_kv_dirs(args)
    llm = LLM(**engine_kwargs(args))
    tok = llm.get_tokenizer()
    use_chat = args.chat if args.chat is not None else bool(getattr(tok, "chat_template", None))
    with llm:  # a tensor-parallel engine's shard processes stop with it
        for prompt in args.prompts:
            if use_chat:
                out = llm.chat([{"role": "user", "content": prompt}], params)[0]
            else:
                out = llm.generate(prompt, params)[0]
            if len(args.prompts) > 1:
                print(f"### {prompt}")
            print(out.outputs[0].text)
    return 0


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for p in action.choices.values():
                _show_defaults(p)
        elif action.help is None and action.option_strings and action.default not in (None, False):
            action.help = "default: %(default)s"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="pdserve", description="Disaggregated prefill/decode LLM serving")
    from pdserve import __version__

    parser.add_argument("--version", action="version", version=f"pdserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    g = sub.add_parser("generate", help="generate text for prompts with a local engine")
    g.add_argument("prompts", nargs="+", help="one or more prompts")
    add_engine_args(g)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--chat", dest="chat", action="store_true", default=None,
                   help="apply the model's chat template (default: when it has one)")
    g.add_argument("--no-chat", dest="chat", action="store_false", default=argparse.SUPPRESS,
                   help="prompts as plain text, without the chat template")
    g.set_defaults(func=cmd_generate)
    from pdserve.serve_cli import add_serve_parser  # argparse only; the cluster loads on use

    add_serve_parser(sub)
    from pdserve.plan_cli import add_plan_parser

    add_plan_parser(sub)
    from pdserve.sim_cli import add_sim_parsers

    add_sim_parsers(sub)
    from pdserve.admin_cli import add_admin_parsers

    add_admin_parsers(sub)
    from pdserve.join_cli import add_join_parser

    add_join_parser(sub)
    from pdserve.bench import add_parser as add_bench  # argparse only; the client loads on use

    add_bench(sub)
    _show_defaults(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    if (sys.argv[1:] if argv is None else argv)[:1] == ["serve"]:
        # first of all: a Ctrl-C from here on stops a server that has not started yet (serve_cli)
        from pdserve.serve_cli import stop_on_signals

        stop_on_signals()
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except CliError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # the engine's or the cluster's refusal: named by the flags typed
        print(f"pdserve: error: {in_flags(str(e))}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
