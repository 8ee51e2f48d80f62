"""`pdserve status` and `pdserve scale`: a running server's admin routes, found by its URL.

Both find the server the same way: `--url`, else `$PDSERVE_URL`, else http://127.0.0.1:8000,
and send the admin key (`--admin-key`, else `$PDSERVE_ADMIN_KEY`). They never join the Ray
cluster: on a host with several clusters the URL names the one meant, and a dead address is
one line after a few seconds instead of Ray's minutes of retries.
"""

from __future__ import annotations

import argparse
import json
import os
import urllib.error
import urllib.request

from pdserve.cli_common import CliError

DEFAULT_URL = "http://127.0.0.1:8000"


def admin_call(args: argparse.Namespace, path: str, body: dict | None = None, timeout: float = 60) -> dict:
    """GET (or POST `body` to) `path` on the server; its refusals and absence as CliError."""
    url = args.url.rstrip("/").removesuffix("/v1")  # the OpenAI base URL names the same server
    key = args.admin_key or os.environ.get("PDSERVE_ADMIN_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    req = urllib.request.Request(url + path, data=data, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:  # the server's own message, not a traceback
        try:
            message = json.loads(e.read())["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = e.reason
        hint = " (set --admin-key or PDSERVE_ADMIN_KEY)" if e.code in (401, 403) else ""
        raise CliError(f"{url}{path} answered HTTP {e.code}: {message}{hint}") from None
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise CliError(f"no pdserve server at {url} ({reason}): start one with `pdserve serve`, "
                       "or pass --url (or set PDSERVE_URL)") from None


def cmd_status(args: argparse.Namespace) -> int:
    """Prints the pools of a running server, one row per worker (GET /admin/status)."""
    status = admin_call(args, "/admin/status")
    rows = sorted(status.get("workers", []), key=lambda w: (w.get("role", ""), w.get("worker_id", "")))
    head = ["worker", "role", "state", "blocks used/total", "running", "waiting", "prefix hits/queries",
            "preemptions"]
    table = []
    for w in rows:
        state = "unreachable" if w.get("error") else \
            f"switching to {w['switching_to']}" if w.get("switching_to") else \
            "draining" if w.get("draining") else "serving"
        table.append([w["worker_id"], w["role"], state,
                      f"{w.get('kv_blocks_used', 0)}/{w.get('kv_blocks_total', 0)}",
                      str(w.get("num_running", 0)), str(w.get("num_waiting", 0)),
                      f"{w.get('prefix_cache_hits', 0)}/{w.get('prefix_cache_queries', 0)}",
                      str(w.get("num_preemptions", 0))])
    widths = [max(len(r[i]) for r in [head, *table]) for i in range(len(head))]
    for r in [head, *table]:
        print("  ".join(c.ljust(wd) for c, wd in zip(r, widths)).rstrip())
    pools = status.get("pools", {})
    print(f"pools: prefill={pools.get('prefill', 0)} decode={pools.get('decode', 0)}")
    return 0


def cmd_scale(args: argparse.Namespace) -> int:
    """Resizes the pools (POST /admin/scale); prints the sizes reached."""
    body = {k: v for k, v in (("prefill", args.prefill), ("decode", args.decode)) if v is not None}
    if not body:
        raise CliError("give --prefill N and/or --decode M (the pool sizes to reach)")
    if args.switch_roles:
        body["switch_roles"] = True
    print(json.dumps(admin_call(args, "/admin/scale", body, timeout=900), indent=2))
    return 0


def _add_server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=os.environ.get("PDSERVE_URL", DEFAULT_URL),
                   help=f"the server (default: $PDSERVE_URL, else {DEFAULT_URL})")
    p.add_argument("--admin-key", default=None, help="the server's admin key (default: $PDSERVE_ADMIN_KEY)")


def add_admin_parsers(sub) -> None:
    sc = sub.add_parser("scale", help="resize the pools of a running server")
    sc.add_argument("--prefill", type=int, default=None)
    sc.add_argument("--decode", type=int, default=None)
    sc.add_argument("--switch-roles", action="store_true",
                    help="reach the sizes by moving workers between the pools (same total; no worker starts)")
    _add_server_args(sc)
    sc.set_defaults(func=cmd_scale)
    st = sub.add_parser("status", help="print the prefill and decode pools of a running server")
    _add_server_args(st)
    st.set_defaults(func=cmd_status)
