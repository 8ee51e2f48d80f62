"""`pdserve join HEAD:PORT`: this host's Ray as a worker node of a multi-host cluster, for as long
as the head's Ray runs (cluster/health/worker_host.py). The on-premises `ray up` config starts
each worker host with it, so that `ray down`, which stops the head's Ray only, leaves no process
on a worker host 5 s later instead of Ray's minute.

    pdserve join 10.0.0.1:6379 [--node-ip-address 10.0.0.2] [-- more ray start flags]
"""

from __future__ import annotations

import argparse

from pdserve.cli_common import CliError


def cmd_join(args: argparse.Namespace) -> int:
    from pdserve.cluster.health.worker_host import join, parse_address, route_address

    try:
        host, port = parse_address(args.address)
        node_ip = args.node_ip_address or route_address(host, port)
    except ValueError as e:
        raise CliError(f"address: {e}") from None
    except OSError as e:  # a name that does not resolve, no route
        raise CliError(f"address: no route to the head {args.address}: {e}") from None
    extra = tuple(args.ray_args[1:] if args.ray_args[:1] == ["--"] else args.ray_args)
    return join(args.address, node_ip, extra)


def add_join_parser(sub) -> None:
    j = sub.add_parser("join", help="run this host's Ray as a worker node until the head's Ray stops",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    j.add_argument("address", help="the head's Ray address, HOST:PORT (its `ray start --head --port`)")
    j.add_argument("--node-ip-address", default=None,
                   help="this host's address in the cluster (default: that of its interface that reaches the head)")
    j.add_argument("ray_args", nargs=argparse.REMAINDER, help="after --: more `ray start` flags")
    j.set_defaults(func=cmd_join)
