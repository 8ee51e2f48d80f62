"""The capacity simulator against a live CPU cluster of the default model, end to end on this
machine: a profile of one engine (`pdserve profile`, one torch thread, as a Ray worker runs; with
--profile-each-rate one taken just before each rate, as this shared machine's speed moves by a
quarter within minutes and a profile taken once was off by that at the later rates), a
live `pdserve serve --mode colocated --decode 2` swept by `pdserve bench`, and the same sweep
predicted from the profile alone (`pdserve simulate`). Nothing of the live run goes into the
prediction. With --profile-in-workers (and --profile-each-rate) each rate is also predicted from the
step cost the live workers fitted to their own steps during a short burst at that rate just before
it (its own prompts, not the measured sweep's: `/admin/status`'s `step_cost`), the rest of the
profile the bare engine's: what the engine costs where a worker runs it, beside the router, the client
and Ray on the same cores.

    python bench/plan_validate_cpu.py --out bench/results/plan/cpu

Writes profile.json, live.json, predicted.json, validation.md / .json / .png under --out (the server's
log in the temp directory) and prints
a short table last (per rate: measured and predicted attainment and latencies; goodput each).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/plan/cpu")
    ap.add_argument("--system", default="colocated:2", help="colocated:N | disagg:P:D | hybrid:P:D")
    ap.add_argument("--rates", default="0.5,1,1.5,2")
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--slo-ttft", type=float, default=2.0)
    ap.add_argument("--slo-tpot", type=float, default=0.2)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--profile", default=None, help="a profile to use instead of measuring one")
    ap.add_argument("--profile-each-rate", action="store_true",
                    help="a profile taken just before each rate, each rate predicted from its own (this machine's "
                         "speed moves by a quarter within minutes)")
    ap.add_argument("--profile-in-workers", action="store_true",
                    help="with --profile-each-rate: also predict each rate from the live workers' own step costs, "
                         "fitted during a burst of --burst requests at that rate just before it")
    ap.add_argument("--burst", type=int, default=40, help="--profile-in-workers: the burst's requests")
    ap.add_argument("--contexts", default="128,256,512")
    ap.add_argument("--batches", default="1,4,16")
    return ap


def pdserve(*args: str, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pdserve", *args], env=env, text=True, **kw)


def serve(system: str, max_model_len: int, log_path: str) -> tuple[subprocess.Popen, str]:
    """`pdserve serve` of `system` on a free port: the process and its URL, once it serves."""
    mode, *sizes = system.split(":")
    pools = ["--decode", sizes[0]] if mode == "colocated" else ["--prefill", sizes[0], "--decode", sizes[1]]
    log = open(log_path, "w")  # noqa: SIM115 - the server's whole life
    proc = subprocess.Popen([sys.executable, "-m", "pdserve", "serve", "--mode", mode, *pools, "--max-model-len",
                             str(max_model_len), "--port", "0"], stdout=subprocess.PIPE, stderr=log, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            raise RuntimeError(f"pdserve serve exited {proc.returncode}: see {log_path}")
        m = re.search(r"on (http://\S+) ", line)
        if m:
            return proc, m.group(1)
    proc.terminate()
    raise RuntimeError(f"pdserve serve did not serve in 600 s: see {log_path}")


def profile(args, path: str) -> None:
    """`pdserve profile` of one engine of the default model, one torch thread (what a Ray worker of one
    CPU runs with), into `path`."""
    pdserve("profile", "--max-model-len", str(args.max_model_len), "--contexts", args.contexts, "--batches",
            args.batches, "--decode-tokens", "16", "--max-tokens-per-point", "8192", "--name", "smollm2-135m",
            "--device-name", f"CPU ({os.cpu_count()} cores)", "--out", path,
            env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True, stdout=subprocess.DEVNULL)


def bench_argv(args, rates: str, seed: int = 0) -> list[str]:
    return ["--workload", "synthetic", "--input-len", str(args.input_len), "--output-len", str(args.output_len),
            "--num-requests", str(args.num_requests), "--rates", rates, "--slo-ttft", str(args.slo_ttft),
            "--slo-tpot", str(args.slo_tpot), *(["--seed", str(seed)] if seed else [])]


def rounds(args) -> list[tuple[str, str, int]]:
    """(rates, name, seed) of each live sweep: the whole sweep at once, or one rate at a time with a
    profile taken just before it (--profile-each-rate). Each rate apart has a seed of its own, as each
    rate of one sweep has a salt of its own: with one seed every rate sent the first's prompts again
    and found them in the prefix cache (77% hits at the fourth rate), which the simulator, started
    afresh for each, did not."""
    if not args.profile_each_rate:
        return [(args.rates, "", 0)]
    return [(r, f"_{r}", i) for i, r in enumerate(args.rates.split(","))]


def workers_profile(args, url: str, rate: str, seed: int, bare: str, out: str) -> None:
    """A burst of `args.burst` requests at `rate` (seed `seed`: prompts of its own), then the live
    workers' step costs (GET /admin/status), averaged, into a copy of the `bare` profile at `out`."""
    import urllib.request

    from pdserve.sim.profile import Profile

    argv = bench_argv(args, rate, seed)
    argv[argv.index("--num-requests") + 1] = str(args.burst)
    pdserve("bench", "--url", url, *argv, "--label", "burst", "--out", tempfile.mkdtemp(), "--name", "burst",
            check=True, stdout=subprocess.DEVNULL)
    with urllib.request.urlopen(url + "/admin/status", timeout=60) as r:
        costs = [w["step_cost"] for w in json.load(r)["workers"] if "step_cost" in w]
    if not costs:
        raise RuntimeError("no worker reports a step cost after the burst")
    prof = Profile.load(bare)
    prof.coefficients = {k: sum(c[k] for c in costs) / len(costs) for k in prof.coefficients}
    prof.device = f"{prof.device}, the step cost of {len(costs)} live workers"
    prof.save(out)


def merged(parts: list[dict]) -> dict:
    """One sweep's result from the results of its rates run apart."""
    from pdserve.bench.report import goodput

    out = dict(parts[0])
    out["runs"] = [run for p in parts for run in p["runs"]]
    out["goodput"] = goodput(out["runs"])
    return out


def main() -> int:
    args = parser().parse_args()
    if args.profile_in_workers and not args.profile_each_rate:
        raise SystemExit("plan_validate_cpu: --profile-in-workers goes with --profile-each-rate")
    os.makedirs(args.out, exist_ok=True)
    bench = bench_argv(args, args.rates)
    t0 = time.time()
    if args.profile is None and not args.profile_each_rate:
        print("profiling one engine of the default model (one thread) ...", flush=True)
        profile(args, os.path.join(args.out, "profile.json"))
    print(f"serving {args.system} and sweeping {args.rates} req/s ...", flush=True)
    log = os.path.join(tempfile.gettempdir(), "plan_validate_cpu_serve.log")
    proc, url = serve(args.system, args.max_model_len, log)
    lives, preds, in_workers = [], [], []
    try:
        for rates, tag, seed in rounds(args):
            prof = args.profile or os.path.join(args.out, f"profile{tag}.json")
            if args.profile_each_rate:  # the server idles meanwhile: this machine's speed now, not minutes ago
                print(f"profiling before rate {rates} ...", flush=True)
                profile(args, prof)
            if args.profile_in_workers:
                print(f"a burst at {rates} req/s for the workers' own step costs ...", flush=True)
                workers_profile(args, url, rates, 1000 + seed, prof,
                                os.path.join(args.out, f"profile{tag}_workers.json"))
            pdserve("bench", "--url", url, *bench_argv(args, rates, seed), "--label", f"live {args.system}", "--out",
                    args.out, "--name", f"live{tag}", check=True)
            pdserve("simulate", "--profile", prof, "--system", args.system, "--out",
                    os.path.join(args.out, f"predicted{tag}.json"), "--", *bench_argv(args, rates, seed), check=True,
                    stdout=subprocess.DEVNULL)
            if args.profile_in_workers:
                pdserve("simulate", "--profile", os.path.join(args.out, f"profile{tag}_workers.json"), "--system",
                        args.system, "--out", os.path.join(args.out, f"predicted{tag}_workers.json"), "--",
                        *bench_argv(args, rates, seed), check=True, stdout=subprocess.DEVNULL)
            for name, into in ((f"live{tag}.json", lives), (f"predicted{tag}.json", preds),
                               *(((f"predicted{tag}_workers.json", in_workers),) if args.profile_in_workers else ())):
                with open(os.path.join(args.out, name)) as f:
                    into.append(json.load(f))
    finally:
        proc.send_signal(2)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
    live, pred = merged(lives), merged(preds)
    if args.profile_each_rate:  # the sweep whole, as the one-profile run writes it
        for name, data in (("live.json", live), ("predicted.json", pred)):
            with open(os.path.join(args.out, name), "w") as f:
                json.dump(data, f, indent=1)
    rows = compare(live, pred)
    g_live, g_pred = live["goodput"]["rps"], pred["goodput"]["rps"]
    err = (g_pred - g_live) / g_live if g_live else None
    result = {"system": args.system, "bench": bench, "rows": rows, "goodput_measured": g_live,
              "goodput_predicted": g_pred, "goodput_error": err, "seconds": round(time.time() - t0),
              "command": "python bench/plan_validate_cpu.py " + " ".join(sys.argv[1:])}
    workers_lines = []
    if in_workers:
        pw = merged(in_workers)
        with open(os.path.join(args.out, "predicted_workers.json"), "w") as f:
            json.dump(pw, f, indent=1)
        g_w = pw["goodput"]["rps"]
        result.update(rows_workers=compare(live, pw), goodput_predicted_workers=g_w,
                      goodput_error_workers=(g_w - g_live) / g_live if g_live else None)
        workers_lines = ["Predicted from the live workers' own step costs (a burst at each rate just before it):",
                         "", "| rate | attainment measured | predicted | TTFT p50 measured | predicted | TPOT p50 "
                         "measured | predicted |", "|---|---|---|---|---|---|---|",
                         *row_lines(result["rows_workers"]), "",
                         f"Goodput: measured {g_live:.2f} req/s, predicted from the workers' step costs {g_w:.2f}"
                         + (f" ({result['goodput_error_workers']:+.0%})." if g_live else "."), ""]
    with open(os.path.join(args.out, "validation.json"), "w") as f:
        json.dump(result, f, indent=1)
    table = ["| rate | attainment measured | predicted | TTFT p50 measured | predicted | TPOT p50 measured | "
             "predicted |", "|---|---|---|---|---|---|---|"]
    table += row_lines(rows)
    text = "\n".join([f"# The simulator against a live CPU cluster ({args.system}, the default model)", "",
                      f"Command: `{result['command']}` ({result['seconds']} s). Workload: `{' '.join(bench)}`.", "",
                      *table, "",
                      f"Goodput (90% attainment): measured {g_live:.2f} req/s, predicted {g_pred:.2f} req/s"
                      + (f" ({err:+.0%})." if err is not None else "."), "", *workers_lines, *speeds(args)])
    with open(os.path.join(args.out, "validation.md"), "w") as f:
        f.write(text)
    plot(rows, os.path.join(args.out, "validation.png"), args.system)
    print("\n" + "\n".join(table))
    print(f"goodput: measured {g_live:.2f}, predicted {g_pred:.2f} req/s"
          + (f" ({err:+.0%})" if err is not None else "")
          + (f"; from the workers' step costs {result['goodput_predicted_workers']:.2f}" if in_workers else ""))
    return 0


def speeds(args) -> list[str]:
    """Each rate's profile, as the decode step of one request it predicts (--profile-each-rate): how
    far this machine's speed moved between them."""
    if not args.profile_each_rate:
        return []
    from pdserve.sim.profile import Profile

    out = []
    for rates, tag, _ in rounds(args):
        p = Profile.load(args.profile or os.path.join(args.out, f"profile{tag}.json"))
        step = p.step_model(4096, None).predict(1, 0, args.input_len, 0)
        out.append(f"rate {rates}: its profile's decode step of one request {step * 1e3:.1f} ms "
                   f"(fit error {p.fit_error:.1%})")
    return ["Each rate's profile, taken just before it:", "", *(f"- {line}" for line in out), ""]


def row_lines(rows: list[dict]) -> list[str]:
    return [f"| {r['rate']:g} | {r['att'][0]:.0%} | {r['att'][1]:.0%} | {r['ttft'][0]:.3f} s | "
            f"{r['ttft'][1]:.3f} s | {r['tpot'][0] * 1e3:.1f} ms | {r['tpot'][1] * 1e3:.1f} ms |" for r in rows]


def compare(live: dict, pred: dict) -> list[dict]:
    """Per rate: (measured, predicted) attainment, TTFT p50 and TPOT p50."""
    rows = []
    for a, b in zip(live["runs"], pred["runs"]):
        rows.append({"rate": a["rate"], "att": (a["slo_attainment"], b["slo_attainment"]),
                     "ttft": (a["ttft_s"]["p50"] or 0.0, b["ttft_s"]["p50"] or 0.0),
                     "tpot": (a["tpot_s"]["p50"] or 0.0, b["tpot_s"]["p50"] or 0.0)})
    return rows


def plot(rows: list[dict], path: str, system: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: no plot", file=sys.stderr)
        return
    rates = [r["rate"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    for ax, key, name, scale in ((axes[0], "att", "SLO attainment", 100), (axes[1], "ttft", "TTFT p50 (s)", 1),
                                 (axes[2], "tpot", "TPOT p50 (ms)", 1000)):
        ax.plot(rates, [r[key][0] * scale for r in rows], "o-", label="measured")
        ax.plot(rates, [r[key][1] * scale for r in rows], "s--", label="predicted")
        ax.set_xlabel("rate (req/s)")
        ax.set_title(name)
    axes[0].legend()
    fig.suptitle(f"simulator vs live CPU cluster ({system}, default model)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
