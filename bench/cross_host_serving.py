"""Each served request's KV transfer as a share of its time to first token, between two hosts
(CPU, gloo; root: a bed of network namespaces, scripts/hosts.sh).

Three hosts: h1 runs Ray's head and `pdserve serve --mode disagg` with the default model
(SmolLM2-135M), h2 offers the prefill pool, h3 the decode pool, each its own Ray node at its own
address with Ray's token auth on. Requests go one at a time (no queue: the share is the link's,
not a backlog's), `--requests` per prompt length, `max_tokens` 4. From the server's own timeline
(GET /admin/timeline) each request's kv_transfer (send start -> received on the decode worker)
and its TTFT (arrival -> first token at the router); the median share kv_transfer / TTFT per
prompt length, on the bridge as it is and on a link shaped with `--tc` (default a 10 Gbit/s
token bucket; the 100 us delay of the issue needs netem, which this kernel lacks).

    python bench/cross_host_serving.py --out bench/results/cross_host/serving       # as root
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import statistics
import subprocess
import sys
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOSTS = os.path.join(ROOT, "scripts", "hosts.sh")
NAME = "xserve"
PORT = 8000


def bed(*args: str, check: bool = True) -> str:
    return subprocess.run(["bash", HOSTS, args[0], "--name", NAME, *args[1:]], check=check, capture_output=True,
                          text=True).stdout


def on(host: str, *cmd: str, env: dict, log) -> subprocess.Popen:
    return subprocess.Popen(["bash", HOSTS, "run", "--name", NAME, host, "--", *cmd], env=env, stdout=log,
                            stderr=subprocess.STDOUT)


def get(url: str, timeout: float = 10) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def complete(url: str, prompt: list[int]) -> None:
    body = json.dumps({"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        r.read()


def wait(pred, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if pred():
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(1)


def measure(url: str, lengths: list[int], n: int, seed: int) -> list[dict]:
    from tqdm import tqdm

    rows = []
    for tokens in lengths:
        shares, transfers, ttfts = [], [], []
        for i in tqdm(range(n + 1), desc=f"{tokens} tokens"):
            prompt = [1 + (seed * 7919 + i * 104729 + k * 31) % 40000 for k in range(tokens)]  # no prefix hit
            complete(url, prompt)
            if i == 0:  # warm-up
                continue
            t = get(f"{url}/admin/timeline?n=1")["requests"][-1]["spans"]
            transfer, ttft = t["recv_done"] - t["send_start"], t["first_token_at_edge"] - t["arrival"]
            shares.append(transfer / ttft)
            transfers.append(transfer)
            ttfts.append(ttft)
        rows.append({"tokens": tokens, "kv_transfer_ms": 1e3 * statistics.median(transfers),
                     "ttft_ms": 1e3 * statistics.median(ttfts), "share": statistics.median(shares),
                     "share_spread": [min(shares), max(shares)]})
    return rows


def render(res: dict) -> str:
    lines = ["# Served KV transfer as a share of TTFT, between two hosts (CPU, gloo)", "",
             f"{res['setup']}", ""]
    for link, rows in res["runs"].items():
        lines += [f"## link: {link}", "", "| prompt tokens | kv_transfer p50 (ms) | TTFT p50 (ms) | transfer / TTFT "
                  "p50 | spread |", "|---|---|---|---|---|"]
        lines += [f"| {r['tokens']} | {r['kv_transfer_ms']:.1f} | {r['ttft_ms']:.0f} | {r['share']:.3f} | "
                  f"{r['share_spread'][0]:.3f}-{r['share_spread'][1]:.3f} |" for r in rows]
        lines.append("")
    return "\n".join(lines)


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for link, rows in res["runs"].items():
        ax.plot([r["tokens"] for r in rows], [100 * r["share"] for r in rows], "o-", label=link)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("KV transfer, % of TTFT (p50)")
    ax.set_title("Served handoff between two hosts")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="512,2048", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--requests", type=int, default=20, help="per prompt length and link, after one warm-up")
    ap.add_argument("--tc", default="tbf rate 10gbit burst 1mb latency 10ms",
                    help="the qdisc of the shaped run on both workers' hosts ('' for none)")
    ap.add_argument("--out", default="bench/results/cross_host/serving")
    args = ap.parse_args()
    bed("down", check=False)
    addr = dict(line.split() for line in bed("up", "3", "--keep", sys.prefix).strip().splitlines())
    url = f"http://{addr['h1']}:{PORT}"
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32), "RAY_worker_niceness": "0"}
    env.pop("GLOO_SOCKET_IFNAME", None)
    os.makedirs(args.out, exist_ok=True)
    log = open(os.path.join(args.out, "server.log"), "w")
    ray = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--disable-usage-stats"]
    res = {"setup": "h1: Ray head + `pdserve serve --mode disagg` (default model, SmolLM2-135M, CPU); h2: the prefill "
                    "pool; h3: the decode pool; one request at a time, max_tokens 4, no prefix hits; median of "
                    f"{args.requests} after one warm-up", "runs": {}}
    try:
        on("h1", *ray, "--head", "--port=6379", f"--node-ip-address={addr['h1']}", "--num-cpus=1",
           "--include-dashboard=false", env=env, log=log)
        for host, role in (("h2", "prefill"), ("h3", "decode")):
            on(host, *ray, f"--address={addr['h1']}:6379", f"--node-ip-address={addr[host]}", "--num-cpus=2",
               f"--resources={json.dumps({f'pdserve_{role}': 2})}", env=env, log=log)
        time.sleep(15)
        on("h1", sys.executable, "-m", "pdserve", "serve", "--address", f"{addr['h1']}:6379", "--host", addr["h1"],
           "--port", str(PORT), "--mode", "disagg", "--prefill", "1", "--decode", "1", env=env, log=log)
        wait(lambda: get(f"{url}/health", 5)["status"] == "ok", 600, "the server healthy")
        res["runs"]["veth"] = measure(url, args.tokens, args.requests, 0)
        if args.tc:
            for h in ("h2", "h3"):
                bed("run", h, "--", "tc", "qdisc", "add", "dev", "eth0", "root", *args.tc.split())
            res["runs"][args.tc] = measure(url, args.tokens, args.requests, 1)
    finally:
        bed("down", check=False)
        log.close()
    with open(os.path.join(args.out, "cross_host_serving.json"), "w") as f:
        json.dump(res, f, indent=2)
    md = render(res)
    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write(md)
    plot(res, os.path.join(args.out, "cross_host_serving.png"))
    print(md)


if __name__ == "__main__":
    main()
