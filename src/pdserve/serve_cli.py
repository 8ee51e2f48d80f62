"""`pdserve serve`'s command line: its flags, the serving config they layer over, the checks
made before any worker starts, and the server's run and stop (the cluster is cluster/, the
HTTP front router/)."""

from __future__ import annotations

import argparse

from pdserve.cli_common import CliError, add_engine_args, check_kv_dirs, engine_kwargs, in_flags
from pdserve.engine.sampling_params import MAX_N

AUTOSCALE_FLAGS = {"target_prefill_queue": "prefill_queue", "target_ttft_p90": "ttft_p90_s",
                   "target_kv_usage": "kv_usage", "target_itl_p90": "itl_p90_s", "autoscale_cooldown": "cooldown_s",
                   "autoscale_idle": "idle_s", "autoscale_policy": "policy"}


def serving_config(args: argparse.Namespace):
    """The serving config: the YAML file (--config) if given, then flags on top."""
    from pdserve.cluster.spec.serving_config import ServingConfig

    cfg = ServingConfig.from_yaml(args.config) if args.config else ServingConfig()
    if args.autoscale:
        cfg.autoscale.enabled = True
    for flag, name in AUTOSCALE_FLAGS.items():
        if getattr(args, flag) is not None:
            setattr(cfg.autoscale, name, getattr(args, flag))
    for flag, name in (("slo_ttft", "ttft_s"), ("slo_tpot", "tpot_s")):
        if getattr(args, flag) is not None:
            setattr(cfg.slo, name, getattr(args, flag))
    if args.handoff_timeout is not None:
        cfg.handoff.timeout_s = args.handoff_timeout
    for role in ("prefill", "decode"):
        pool = cfg.pool(role)
        for bound in ("min", "max"):
            if getattr(args, f"{bound}_{role}") is not None:
                setattr(pool, bound, getattr(args, f"{bound}_{role}"))
        if args.gpus_per_worker is not None:
            pool.num_gpus = args.gpus_per_worker
        if getattr(args, f"{role}_tp") is not None:
            pool.tensor_parallel_size = getattr(args, f"{role}_tp")
        if args.pool_resources == "on":
            pool.resources = {f"pdserve_{role}": 1}
        elif args.pool_resources == "off":
            pool.resources = {}
    return cfg.validate()


def _interrupt(sig, frame):
    """SIGTERM as Ctrl-C: the server's `finally` stops the cluster (the default handler would
    end the process first). The signal is noted too: raised inside an import that a C extension
    runs (Ray's first serialization context imports pydantic.v1 as the registry actor is created),
    the KeyboardInterrupt can come out as another error (a TypeError), and a start that fails
    after a stop signal is a stop, not a crash."""
    STOPS.append(sig)
    raise KeyboardInterrupt


STOPS: list[int] = []  # signals that came while the server imported what it runs on


def _note(sig, frame):
    STOPS.append(sig)


def stop_on_signals() -> None:
    """Ctrl-C and SIGTERM stop a server that is still starting as they stop one that serves, also
    when it was started with SIGINT ignored (a script's `pdserve serve ... &`): Python then
    installs no handler of its own. `pdserve serve` installs this first, before anything heavy is
    imported (torch, Ray, FastAPI: 5-13 s on a loaded host, during which a Ctrl-C was lost). Until
    those imports are done a signal is only noted (an exception raised inside a C extension's
    import leaves it half loaded: numpy then refused to load again); `stop_requested()` reads it."""
    import signal

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _note)


def stop_requested() -> bool:
    """A signal came while the server imported: it stops before it starts anything (one line)."""
    if STOPS:
        import sys

        print("pdserve: stopped before serving", file=sys.stderr, flush=True)
    return bool(STOPS)


def check_listen(args: argparse.Namespace) -> None:
    """What can be known before the cluster starts: the pool sizes asked for, and a port this
    host can listen on now (a busy port was otherwise found only after every worker started)."""
    import socket

    for role in ("prefill", "decode"):
        n = getattr(args, role)
        if n is not None and n < 1:
            raise CliError(f"--{role} must be >= 1, got {n}" + (" (--mode colocated has no prefill pool)"
                                                                 if role == "prefill" else ""))
    for flag in ("max_queue", "max_queue_per_client", "max_request_tokens"):
        n = getattr(args, flag)
        if n is not None and n < 1:
            raise CliError(f"--{flag.replace('_', '-')} must be >= 1, got {n}")
    if not 0 <= args.port < 65536:
        raise CliError(f"--port must be in 0..65535 (0: any free port), got {args.port}")
    with socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((args.host, args.port))
        except OSError as e:
            raise CliError(f"cannot listen on {args.host}:{args.port}: {e.strerror} (another server there? "
                           "pick --port)") from None


def cmd_serve(args: argparse.Namespace) -> int:
    import os
    import signal
    import sys
    import time

    if signal.getsignal(signal.SIGINT) is not _note:  # called without main(): no signal noted yet
        stop_on_signals()
    # the checks first: a refusal is one line in a fraction of a second, before torch, Ray and the
    # router are imported (seconds on a small machine)
    kwargs = engine_kwargs(args)
    kwargs.pop("model", None)
    if args.enable_auto_tool_choice != (args.tool_call_parser is not None):
        raise CliError("--enable-auto-tool-choice and --tool-call-parser NAME go together (tool_choice auto)")
    check_listen(args)
    if args.address is None:  # a local cluster: its workers use this host's directories
        check_kv_dirs(args)
    try:  # a bad config file or value: one line in the config's own words, before anything starts
        config = serving_config(args)
    except ValueError as e:
        raise CliError(str(e)) from None

    from pdserve.cluster import Cluster, ClusterSpec
    from pdserve.cluster.health.local_ray import GcsWatch, RayStartError
    from pdserve.router.app import build_app
    from pdserve.router.server import Server
    from pdserve.router.server import config as server_config

    if stop_requested():
        return 0
    # from here on a signal raises KeyboardInterrupt, which every stage below stops on cleanly
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)

    if args.address is None:  # a Ray of our own is this machine only (joined: each node's own address)
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    api_key = args.api_key or os.environ.get("PDSERVE_API_KEY")
    admin_key = args.admin_key or os.environ.get("PDSERVE_ADMIN_KEY")
    t0 = time.monotonic()

    def progress(message: str) -> None:
        print(f"pdserve: [{time.monotonic() - t0:5.1f} s] {message}", file=sys.stderr, flush=True)

    try:
        spec = ClusterSpec.of(args.model, args.prefill, args.decode, mode=args.mode, serving_config=config,
                              address=args.address, namespace=args.namespace,
                              local_prefill_tokens=args.local_prefill_tokens,
                              local_cached_fraction=args.local_cached_fraction,
                              prefill_engine_args=prefill_engine_kwargs(args), **kwargs)
        cluster = Cluster(spec, progress=progress)
    except (KeyboardInterrupt, SystemExit):  # stopped while starting (SystemExit: ray.init's own SIGTERM
        progress("stopped before serving")  # handler, until ours is back): what had started is stopped
        return 0
    except Exception as e:
        if STOPS:  # the signal's interrupt, raised inside an import, came out as this (_interrupt)
            progress(f"stopped before serving ({type(e).__name__} as the signal broke off the start)")
            return 0
        if isinstance(e, ValueError):  # a spec a worker refused (WorkerRefused), or an argument: one line
            raise CliError(in_flags(str(e))) from None
        if isinstance(e, RayStartError):  # Ray did not start or could not be joined: one line, no traceback
            raise CliError(str(e)) from None
        raise
    lost: list[str] = []  # why the Ray's GCS went away under the server, if it did (GcsWatch)
    try:
        app = build_app(cluster, api_key=api_key, admin_key=admin_key, max_body_bytes=args.max_body_bytes,
                        max_queue=args.max_queue, served_model_name=args.served_model_name,
                        chat_special_tokens=args.chat_special_tokens, tool_call_parser=args.tool_call_parser,
                        root_path=args.root_path, options=server_options(args),
                        max_queue_per_client=args.max_queue_per_client)
        pools = cluster.pool_sizes()
        tp = {r: f"{pools[r]} x TP{cluster.pools.tp(r)}" for r in pools}
        sizes = f"colocated={tp['decode']}" if cluster.mode == "colocated" else \
            f"{cluster.mode}, prefill={tp['prefill']}, decode={tp['decode']}"
        slo = cluster.serving.slo

        def listening(port: int) -> None:  # printed once the port is bound: a client reading it can connect
            print(f"pdserve: serving {cluster.model_path} on http://{args.host}:{port} ({sizes}, "
                  f"SLO ttft {slo.ttft_s:g} s tpot {slo.tpot_s * 1000:g} ms, "
                  f"autoscale={'on' if cluster.serving.autoscale.enabled else 'off'})", flush=True)

        server = Server(server_config(app, args.host, args.port, args.log_level), on_listening=listening)
        stop = server.handle_exit

        def on_signal(sig, frame):  # Ctrl-C reaches the workers too: they end, they are not replaced
            cluster.closing()
            stop(sig, frame)

        server.handle_exit = on_signal

        def ray_lost(why: str) -> None:  # its workers went with it: nothing to serve, nothing to stop
            lost.append(why)
            stop(signal.SIGTERM, None)

        watch = GcsWatch(ray_lost)
        signal.signal(signal.SIGTERM, _interrupt)  # what uvicorn raises again once it has stopped
        try:
            server.run()
        except KeyboardInterrupt:  # uvicorn raises the captured signal again once it has stopped
            pass
        watch.stop()
    finally:
        if lost:  # Ray's calls (the workers' stop, its own shutdown and exit hooks) would wait on the gone GCS
            print(f"pdserve: {lost[0]}; its workers are gone with it: stopped", file=sys.stderr, flush=True)
            os._exit(1)
        cluster.shutdown()
    return 0


def server_options(args: argparse.Namespace):
    """The router's server-wide defaults (router/options.py) from their flags."""
    from pdserve.router.options import ServerOptions

    return ServerOptions(force_include_usage=args.enable_force_include_usage,
                         return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                         load_tracking=args.enable_server_load_tracking,
                         max_request_tokens=args.max_request_tokens)


def prefill_engine_kwargs(args: argparse.Namespace) -> dict:
    """The prefill pool's overrides of the engine flags."""
    n = args.prefill_max_num_batched_tokens
    return {} if n is None else {"max_num_batched_tokens": n}


def add_serve_parser(sub) -> None:
    sv = sub.add_parser("serve", help="start a cluster and its OpenAI-compatible HTTP router")
    add_engine_args(sv)
    sv.add_argument("--prefill", type=int, default=None, help="prefill workers (default: config's, else 1)")
    sv.add_argument("--decode", type=int, default=None, help="decode workers (default: config's, else 1)")
    sv.add_argument("--mode", choices=("hybrid", "disagg", "disaggregated", "colocated"), default="hybrid",
                    help="hybrid: each prompt on the prefill pool or a decode worker, by predicted TTFT under "
                         "the SLO; disagg: always the prefill pool; colocated: the baseline, --decode N engines "
                         "that prefill (chunked) and decode")
    sv.add_argument("--slo-ttft", type=float, default=None, help="TTFT target in seconds (default: config's, else 2)")
    sv.add_argument("--slo-tpot", type=float, default=None,
                    help="time per output token target in seconds (default: config's, else 0.05)")
    sv.add_argument("--handoff-timeout", type=float, default=None,
                    help="seconds a KV handoff may take before it fails (default: the config's handoff.timeout_s, "
                         "else 30); long prompts on a busy host may need more")
    sv.add_argument("--config", default=None, help="serving config YAML: pools, resources, autoscaling targets")
    sv.add_argument("--autoscale", action="store_true", help="turn on the autoscaling policy")
    for role in ("prefill", "decode"):
        sv.add_argument(f"--min-{role}", type=int, default=None, help=f"autoscaler's lower bound for {role}")
        sv.add_argument(f"--max-{role}", type=int, default=None, help=f"autoscaler's upper bound for {role}")
    sv.add_argument("--target-prefill-queue", type=float, default=None, help="waiting prompts per prefill worker")
    sv.add_argument("--target-ttft-p90", type=float, default=None, help="seconds")
    sv.add_argument("--target-kv-usage", type=float, default=None, help="fraction of decode KV blocks in use")
    sv.add_argument("--target-itl-p90", type=float, default=None, help="seconds")
    sv.add_argument("--autoscale-cooldown", type=float, default=None, help="seconds between changes of a pool")
    sv.add_argument("--autoscale-idle", type=float, default=None, help="seconds calm before a pool shrinks")
    sv.add_argument("--autoscale-policy", choices=("signals", "ratio"), default=None,
                    help="signals: each pool grows and shrinks by its own signals; ratio: the workers there are "
                         "move between the pools to the prefill:decode split the measured load needs")
    sv.add_argument("--pool-resources", choices=("auto", "on", "off"), default="auto",
                    help="request pdserve_prefill / pdserve_decode per actor (auto: when a node offers them)")
    sv.add_argument("--gpus-per-worker", type=float, default=None,
                    help="GPUs per rank of a worker (default: 1 when the cluster has GPUs)")
    for role in ("prefill", "decode"):
        sv.add_argument(f"--{role}-tp", type=int, default=None,
                        help=f"tensor-parallel size of each {role} worker (default: the config's, else "
                             "--tensor-parallel-size)")
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000, help="0: any free port, named in the serving line")
    sv.add_argument("--root-path", default="",
                    help="the path prefix a proxy serves this server under (e.g. /llm): routes answer below it too")
    sv.add_argument("--address", default=None, help="join this Ray cluster (auto | host:port); default: start one")
    sv.add_argument("--namespace", default="pdserve", help="the Ray namespace of this server's actors")
    sv.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY (or env PDSERVE_API_KEY)")
    sv.add_argument("--admin-key", default=None,
                    help="the key of /admin/* (or env PDSERVE_ADMIN_KEY); with --api-key and no admin key they are off")
    sv.add_argument("--served-model-name", default=None)
    sv.add_argument("--chat-special-tokens", choices=("refuse", "allow"), default="refuse",
                    help="a chat message that spells a special token (e.g. <|im_start|>): 400, or read as the token "
                         "(vLLM's default)")
    sv.add_argument("--enable-auto-tool-choice", action="store_true",
                    help='serve tool_choice "auto" (with --tool-call-parser)')
    sv.add_argument("--tool-call-parser", choices=("hermes", "llama3_json", "mistral"), default=None,
                    help="the model's tool-call format: hermes (Qwen 2.5, Hermes), llama3_json (Llama 3.x), mistral")
    sv.add_argument("--enable-force-include-usage", action="store_true",
                    help="every streamed response ends with its usage, asked for or not (vLLM's flag)")
    sv.add_argument("--return-tokens-as-token-ids", action="store_true",
                    help='log-probs name tokens "token_id:<id>" unless a request says otherwise (vLLM\'s flag)')
    sv.add_argument("--enable-server-load-tracking", action="store_true",
                    help="GET /load answers the requests in flight (vLLM's flag)")
    sv.add_argument("--max-body-bytes", type=int, default=1 << 20)
    sv.add_argument("--max-queue", type=int, default=256, help="requests in flight before 429")
    sv.add_argument("--max-queue-per-client", type=int, default=None,
                    help="requests in flight from one client (its address) before its 429; others are still "
                         "admitted (default: 3/4 of --max-queue; --max-queue: no bound of its own)")
    sv.add_argument("--max-request-tokens", type=int, default=None,
                    help="the most work one request may ask for, in tokens: its prompts (x n with "
                         "prompt_logprobs) plus n x max_tokens of each; more is a 400 naming this flag "
                         f"(default: {MAX_N} x --max-model-len: one prompt at any n always fits)")
    sv.add_argument("--prefill-max-num-batched-tokens", type=int, default=None,
                    help="the prefill pool's chunk budget (default: --max-num-batched-tokens if given, else 8192)")
    sv.add_argument("--local-prefill-tokens", type=int, default=0,
                    help="prompts up to this many tokens prefill on the decode worker (0: off)")
    sv.add_argument("--local-cached-fraction", type=float, default=2.0,
                    help="prefill on a decode worker that caches this fraction of the prompt (>1: off)")
    sv.add_argument("--log-level", default="warning")
    sv.set_defaults(func=cmd_serve)
