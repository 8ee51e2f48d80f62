"""Capacity planning: profiles of one worker (profile.py, measured by `pdserve profile`:
profiler.py), a simulator of a whole cluster that runs the cluster's own placement and the
engine's own scheduling in simulated time (cluster.py, engine.py), and the serving benchmark's
sweeps predicted from them (`predict`).

    predict(profile, "hybrid:1:1", ["--workload", "synthetic", "--input-len", "4096", ...])
        -> the same result dict `pdserve bench` writes (runs per rate, goodput), predicted

The bench arguments are `pdserve bench`'s own, so a committed serving run is predicted from its
recorded command: the same prompts, lengths, seeds and arrival times.
"""

from __future__ import annotations

import argparse

from .profile import Link, Profile

__all__ = ["Layout", "Link", "Profile", "Simulation", "bench_args", "predict"]


def __getattr__(name: str):
    """`Layout` and `Simulation` on first use: the simulator runs the cluster's placement, which
    imports Ray; a profile (`pdserve profile`, profile_gpu.py --sharing) is measured without it."""
    if name in ("Layout", "Simulation"):
        from . import cluster

        return getattr(cluster, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def bench_args(argv: list[str]) -> argparse.Namespace:
    """`pdserve bench`'s arguments parsed as the bench parses them."""
    from pdserve.bench import add_parser

    parser = argparse.ArgumentParser(prog="pdserve")
    add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["bench", *argv])


def predict(profile: Profile, system: str, argv: list[str], one_gpu: bool = False,
            prefill_profile: Profile | None = None, progress=None, give_up_below: float | None = None) -> dict:
    """The bench sweep `argv` against the cluster `system` (colocated:N, disagg:P:D, hybrid:P:D),
    predicted. A hybrid or colocated server serves the sweep's SLO (the serving runs tell it so);
    a disaggregated one keeps the server's default (its decode workers take no TPOT target).
    `give_up_below`: a rate stops once its attainment is sure to be under this (its reported
    attainment is then under it too, not the full run's; Simulation.run)."""
    from pdserve.bench import sweep
    from pdserve.bench.report import goodput, summarize
    from pdserve.cluster.spec.serving_config import SloConfig

    from .cluster import Layout, Simulation

    args = bench_args(argv)
    layout = Layout.of(system, one_gpu)
    ttft, tpot = args.slo_ttft or SloConfig.ttft_s, args.slo_tpot or SloConfig.tpot_s
    told = layout.mode in ("hybrid", "colocated")
    # the ratio policy (adaptive) checks the window's latencies against the server's SLO: the sweep's
    slo = SloConfig(ttft, tpot) if told or layout.adaptive else SloConfig()
    runs, desc = [], ""
    for reqs, arrivals, rate, desc in sweep(args):  # noqa: B007 (the last one is reported)
        sim = Simulation(profile, layout, slo, tpot if told else None, prefill_profile)
        if layout.mode == "disagg":
            for e in sim.engines.values():
                e.model.slo_tpot_s = None
        records, duration = sim.run(reqs, arrivals, None if give_up_below is None else (give_up_below, ttft, tpot))
        summary = summarize(records, duration, rate, ttft, tpot)
        summary["routing"] = dict(sim.routing)
        if sim.mover is not None:
            summary["moves"] = sim.mover.events()
        runs.append(summary)
        if progress is not None:
            progress(summary)
    return {"label": f"{layout.describe()} (predicted)", "model": profile.model,
            "config": {"workload": args.workload, "workload_desc": desc, "ttft_slo": ttft, "tpot_slo": tpot,
                       "num_requests": args.num_requests, "seed": args.seed, "profile": profile.device},
            "runs": runs, "goodput": goodput(runs)}
