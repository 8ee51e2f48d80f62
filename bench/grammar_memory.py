"""Memory per distinct grammar: a real `pdserve serve` (disaggregated 1P1D, the default model, CPU)
gets N chat requests, each with a JSON schema of its own, one at a time; every few requests the
resident memory (RSS) of the router process and of each worker process is read from /proc. A
warm-up of unconstrained requests first writes every block of a small KV cache, so what grows
after it is what the grammars leave behind (`--no-grammar` runs the same requests without one).

    python bench/grammar_memory.py --label after          # one run: grammar_memory_after.json
    python bench/grammar_memory.py --plot before after    # the table and plot of runs already made
    python bench/grammar_memory.py --ship 20              # in one process: compile vs shipping compiled

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


PROPS8_TYPES = [{"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"},
                {"type": "array", "items": {"type": "string"}}, {"type": "string", "enum": ["a", "b", "c"]},
                {"type": "string", "maxLength": 20}, {"type": "integer", "minimum": 0, "maximum": 100}]


def props8(i: int) -> dict:
    """The i-th schema of 8 plain properties, each name its own (the shape a client with one
    schema per tool or per record type sends)."""
    props = {f"field_{i}_{j}": PROPS8_TYPES[(i + j) % 8] for j in range(8)}
    return {"type": "object", "properties": props, "required": list(props)}


KINDS = {"mixed": schema, "props8": props8}


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


def start_server(port: int, kv_bytes: int = KV_BYTES) -> subprocess.Popen:
    """`kv_bytes` 0: the server's own KV budget (1 GiB on CPU), whose pages the warm-up leaves mostly
    untouched: they are then committed as requests fill new blocks, whatever the grammars do."""
    cmd = [sys.executable, "-m", "pdserve", "serve", "--mode", "disagg", "--prefill", "1", "--decode", "1",
           "--device", "cpu", "--port", str(port), "--max-model-len", "2048", "--log-level", "warning"]
    if kv_bytes:
        cmd += ["--kv-cache-memory-bytes", str(kv_bytes)]
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
    server = start_server(port, args.kv_bytes)
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
                                        "json_schema": {"name": f"record_{i}", "schema": KINDS[args.kind](i)}}}
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
                       + (f" --kind {args.kind}" if args.kind != "mixed" else "")
                       + (" --no-grammar" if args.no_grammar else "")
                       + (f" --kv-bytes {args.kv_bytes}" if args.kv_bytes != KV_BYTES else ""),
            "machine": "CPU (2 cores), default model SmolLM2-135M-Instruct, pdserve serve --mode disagg 1P1D, "
                       + (f"--kv-cache-memory-bytes {args.kv_bytes}" if args.kv_bytes else
                          "the default KV budget (1 GiB)")
                       + f", {WARMUP} warm-up requests",
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
    last = max(r["rows"][-1]["schemas"] for r in runs)
    marks = sorted({0, 339, *((1000,) if last > 1000 else ()), last})
    head = " / ".join(str(m) for m in marks)
    lines = [f"| run | errors | router MiB at {head} schemas | workers MiB at {head} (each) "
             "| router, workers MiB / schema over the last 500 |", "| --- | --- | --- | --- | --- |"]
    for n, run_ in enumerate(runs):
        rows = run_["rows"]
        xs = [r["schemas"] for r in rows]
        ax[0].plot(xs, [r["router"] for r in rows], color=f"C{n}", label=run_["label"])
        for k in range(len(rows[0]["workers"])):
            ax[1].plot(xs, [r["workers"][k] for r in rows], color=f"C{n}", linestyle=("-", "--", ":")[k % 3],
                       label=f"{run_['label']}: worker {k}")
        at = [min(rows, key=lambda r, m=m: abs(r["schemas"] - m)) if m <= xs[-1] else None for m in marks]
        tail = [r for r in rows if r["schemas"] >= rows[-1]["schemas"] - 500]
        span = max(1, tail[-1]["schemas"] - tail[0]["schemas"])
        slopes = [growth(tail, "router") / span, growth(tail, "workers") / len(rows[0]["workers"]) / span]
        workers = " / ".join(", ".join(f"{w:.0f}" for w in r["workers"]) if r else "-" for r in at)
        router = " / ".join(f"{r['router']:.0f}" if r else "-" for r in at)
        per = f"{slopes[0]:.3f}, {slopes[1]:.3f}"
        lines.append(f"| {run_['label']} | {run_['errors']} | {router} | {workers} | {per} |")
    for a, title in zip(ax, ("router process", "worker processes")):
        a.set_xlabel("distinct JSON schemas served")
        a.set_ylabel("RSS (MiB)")
        a.set_title(title)
        a.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(OUT, "grammar_memory.png"), dpi=110)
    md = "\n".join(["# Memory per distinct grammar", "", *(f"- {r['label']}: `{r['command']}`; {r['machine']}"
                                                          for r in runs), "", *lines, ""])
    with open(os.path.join(OUT, "grammar_memory.md"), "w") as f:
        f.write(md)
    print(md)


def ship(n: int) -> None:
    """Would shipping a compiled grammar (one compile for the cluster) beat compiling it on each
    worker? Per schema: a compile (fresh compiler, no cache), xgrammar's serialization (JSON,
    the one format it has), its size, and the deserialization a worker would run."""
    import statistics

    import xgrammar as xgr
    from transformers import AutoTokenizer

    from pdserve.engine.default_model import default_model_path

    tok = AutoTokenizer.from_pretrained(default_model_path())
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    rows = []
    for i in range(n):
        compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        t0 = time.perf_counter()
        cg = compiler.compile_json_schema(json.dumps(schema(i)))
        t1 = time.perf_counter()
        text = cg.serialize_json()
        t2 = time.perf_counter()
        xgr.CompiledGrammar.deserialize_json(text, info)
        t3 = time.perf_counter()
        rows.append({"schema": i, "compile_s": t1 - t0, "serialize_s": t2 - t1, "deserialize_s": t3 - t2,
                     "serialized_mb": len(text) / 1e6, "in_memory_mb": cg.memory_size_bytes / 1e6})
    keys = ("compile_s", "serialize_s", "deserialize_s", "serialized_mb", "in_memory_mb")
    med = {k: statistics.median(r[k] for r in rows) for k in keys}
    top = {k: max(r[k] for r in rows) for k in keys}
    from importlib.metadata import version

    out = {"command": f"python bench/grammar_memory.py --ship {n}", "machine": f"CPU (2 cores), xgrammar "
           f"{version('xgrammar')}, the default model's tokenizer", "median": med, "max": top, "rows": rows}
    with open(os.path.join(OUT, "grammar_ship.json"), "w") as f:
        json.dump(out, f, indent=1)
    md = ["# Shipping a compiled grammar vs compiling it again", "", f"`{out['command']}`; {out['machine']}.", "",
          "| per schema | compile s | serialize s | deserialize s | serialized MB | in memory MB |",
          "| --- | --- | --- | --- | --- | --- |",
          *(f"| {name} | " + " | ".join(f"{d[k]:.3f}" for k in keys) + " |" for name, d in (("median", med),
                                                                                       ("max", top))), ""]
    with open(os.path.join(OUT, "grammar_ship.md"), "w") as f:
        f.write("\n".join(md))
    print("\n".join(md))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", default="run")
    ap.add_argument("--schemas", type=int, default=339)
    ap.add_argument("--kind", choices=sorted(KINDS), default="mixed",
                    help="mixed: nested seeded schemas; props8: 8 plain properties each")
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--no-grammar", action="store_true", help="the control: the same requests, unconstrained")
    ap.add_argument("--kv-bytes", type=int, default=KV_BYTES,
                    help="each worker's KV budget (0: the server's default, 1 GiB on CPU)")
    ap.add_argument("--ship", type=int, default=0, help="compile vs serialize / deserialize for N schemas")
    ap.add_argument("--plot", nargs="*", help="labels of runs already made: write the table and plot only")
    args = ap.parse_args()
    if args.plot:
        return report(args.plot)
    if args.ship:
        return ship(args.ship)
    os.makedirs(OUT, exist_ok=True)
    result = run(args)
    with open(os.path.join(OUT, f"grammar_memory_{args.label}.json"), "w") as f:
        json.dump(result, f, indent=1)
    report([args.label])


if __name__ == "__main__":
    main()
