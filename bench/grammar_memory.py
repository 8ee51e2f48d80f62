"""Memory per distinct grammar: a real `pdserve serve` (disaggregated 1P1D, the default model, CPU)
gets N chat requests, each with a JSON schema of its own, one at a time; every few requests the
resident memory (RSS) of the router process and of each worker process is read from /proc. A
warm-up of unconstrained requests first writes every block of a small KV cache, so what grows
after it is what the grammars leave behind (`--no-grammar` runs the same requests without one).

    python bench/grammar_memory.py --label after          # one run: grammar_memory_after.json
    python bench/grammar_memory.py --plot before after    # the table and plot of runs already made

The schemas are generated from their index (a seeded mix of strings with lengths, integer
ranges, enums, patterns, arrays and nested objects, 4-14 top-level fields), so every run sends
the same N schemas. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time

# a small KV cache, touched whole by the warm-up: a CPU cache is allocated lazily, so its pages
# would otherwise show up as growth while new blocks are first written (0.7 MiB a block here)
KV_BYTES = 64 << 20
WARMUP = 80  # unconstrained requests before the first sample
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "grammar")


def schema(i: int) -> dict:
    """The i-th schema of the experiment (deterministic)."""
    r = random.Random(i)

    def prop(depth: int) -> dict:
        kinds = ["string", "int", "enum", "array", "object", "pattern", "number", "bool"] if depth < 3 else \
            ["string", "int", "enum"]
        k = r.choice(kinds)
        if k == "string":
            return {"type": "string", "maxLength": r.randint(3, 40)}
        if k == "int":
            return {"type": "integer", "minimum": r.randint(-100, 0), "maximum": r.randint(1, 10 ** 6)}
        if k == "enum":
            return {"type": "string", "enum": [f"v{i}_{j}_{r.randint(0, 999)}" for j in range(r.randint(2, 8))]}
        if k == "pattern":
            return {"type": "string", "pattern": r.choice([r"^[A-Z]{2}-\d{4}$", r"^\d{3}-\d{3}-\d{4}$",
                                                           r"^[a-z]+@[a-z]+\.com$"])}
        if k in ("number", "bool"):
            return {"type": "number" if k == "number" else "boolean"}
        if k == "array":
            return {"type": "array", "items": prop(depth + 1), "minItems": 1, "maxItems": r.randint(2, 6)}
        props = {f"p{i}_{depth}_{j}": prop(depth + 1) for j in range(r.randint(2, 6))}
        return {"type": "object", "properties": props, "required": list(props)[: r.randint(1, len(props))],
                "additionalProperties": False}

    props = {f"field_{i}_{j}": prop(0) for j in range(r.randint(4, 14))}
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb / 1024


def processes(session: int) -> dict[int, str]:
    """pid -> command line of the processes in the server's session."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            if os.getsid(int(d)) != session:
                continue
            with open(f"/proc/{d}/cmdline", "rb") as f:
                out[int(d)] = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, ProcessLookupError):
            continue
    return out


def sample(server: subprocess.Popen) -> dict:
    """RSS of the router (the serve process) and of the workers."""
    procs = processes(server.pid)
    workers = sorted(p for p, cmd in procs.items() if cmd.startswith("ray::WorkerActor"))
    return {"router": rss_mib(server.pid), "workers": [rss_mib(p) for p in workers]}


def start_server(port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pdserve", "serve", "--mode", "disagg", "--prefill", "1", "--decode", "1",
           "--device", "cpu", "--port", str(port), "--max-model-len", "2048", "--log-level", "warning",
           "--kv-cache-memory-bytes", str(KV_BYTES)]
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import httpx

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"pdserve serve exited with {proc.returncode}")
        time.sleep(1)
    stop_server(proc)
    raise RuntimeError("pdserve serve did not answer /health within 300 s")


def stop_server(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGINT, 60), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run(args) -> dict:
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = start_server(port)
    rows, errors = [], 0
    try:
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120)
        model = client.get("/v1/models").json()["data"][0]["id"]
        for i in range(WARMUP):
            client.post("/v1/chat/completions", json={"model": model, "max_tokens": args.max_tokens, "messages": [
                {"role": "user", "content": f"Warm-up {i}: say something about the number {i * 7919}."}]})
        rows.append({"schemas": 0, **sample(server)})
        t0 = time.monotonic()
        for i in range(args.schemas):
            body = {"model": model, "max_tokens": args.max_tokens,
                    "messages": [{"role": "user", "content": f"Fill in record {i}."}],
                    "response_format": {"type": "json_schema",
                                        "json_schema": {"name": f"record_{i}", "schema": schema(i)}}}
            if args.no_grammar:  # the control: the same requests without a grammar
                del body["response_format"]
            r = client.post("/v1/chat/completions", json=body)
            if r.status_code != 200:
                errors += 1
                print(f"schema {i}: HTTP {r.status_code} {r.text[:300]}", flush=True)
            if (i + 1) % args.every == 0 or i + 1 == args.schemas:
                rows.append({"schemas": i + 1, "seconds": round(time.monotonic() - t0, 1), **sample(server)})
                last = rows[-1]
                print(f"{i + 1:4d} schemas  router {last['router']:6.0f} MiB  workers "
                      f"{' '.join(f'{w:6.0f}' for w in last['workers'])} MiB  errors {errors}", flush=True)
    finally:
        stop_server(server)
    return {"label": args.label, "schemas": args.schemas, "max_tokens": args.max_tokens, "errors": errors,
            "command": f"python bench/grammar_memory.py --label {args.label} --schemas {args.schemas}"
                       + (" --no-grammar" if args.no_grammar else ""),
            "machine": "CPU (2 cores), default model SmolLM2-135M-Instruct, pdserve serve --mode disagg 1P1D, "
                       f"--kv-cache-memory-bytes {KV_BYTES}, {WARMUP} warm-up requests",
            "rows": rows}


def growth(rows: list[dict], key: str) -> float:
    """MiB the process grew from the first sample to the last (the sum over workers)."""
    def val(r):
        v = r[key]
        return sum(v) if isinstance(v, list) else v
    return val(rows[-1]) - val(rows[0])


def report(labels: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [json.load(open(os.path.join(OUT, f"grammar_memory_{label}.json"))) for label in labels]
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    lines = ["| run | schemas | errors | router MiB (start -> end) | router growth MiB / schema (last 200) "
             "| workers MiB (start -> end, each) |", "| --- | --- | --- | --- | --- | --- |"]
    for run_ in runs:
        rows = run_["rows"]
        xs = [r["schemas"] for r in rows]
        ax[0].plot(xs, [r["router"] for r in rows], label=run_["label"])
        for k in range(len(rows[0]["workers"])):
            ax[1].plot(xs, [r["workers"][k] for r in rows], label=f"{run_['label']}: worker {k}")
        tail = [r for r in rows if r["schemas"] >= rows[-1]["schemas"] - 200]
        slope = growth(tail, "router") / max(1, tail[-1]["schemas"] - tail[0]["schemas"])
        ws = ", ".join(f"{a:.0f} -> {b:.0f}" for a, b in zip(rows[0]["workers"], rows[-1]["workers"]))
        lines.append(f"| {run_['label']} | {run_['schemas']} | {run_['errors']} | {rows[0]['router']:.0f} -> "
                     f"{rows[-1]['router']:.0f} | {slope:.3f} | {ws} |")
    for a, title in zip(ax, ("router process", "worker processes")):
        a.set_xlabel("distinct JSON schemas served")
        a.set_ylabel("RSS (MiB)")
        a.set_title(title)
        a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(OUT, "grammar_memory.png"), dpi=110)
    md = "\n".join(["# Memory per distinct grammar", "", *(f"- `{r['command']}`" for r in runs), "",
                    f"Machine: {runs[-1]['machine']}.", "", *lines, ""])
    with open(os.path.join(OUT, "grammar_memory.md"), "w") as f:
        f.write(md)
    print(md)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", default="run")
    ap.add_argument("--schemas", type=int, default=339)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--no-grammar", action="store_true", help="the control: the same requests, unconstrained")
    ap.add_argument("--plot", nargs="*", help="labels of runs already made: write the table and plot only")
    args = ap.parse_args()
    if args.plot:
        return report(args.plot)
    os.makedirs(OUT, exist_ok=True)
    result = run(args)
    with open(os.path.join(OUT, f"grammar_memory_{args.label}.json"), "w") as f:
        json.dump(result, f, indent=1)
    report([args.label])


if __name__ == "__main__":
    main()
