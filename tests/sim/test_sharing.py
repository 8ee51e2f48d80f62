"""Two engines on one device: measured (sharing.measure, two real engines in two processes) and
simulated (SimGpu runs their steps side by side, each slowed by its measured factor)."""

import pathlib

import pytest

from pdserve.sim import Profile, predict
from pdserve.sim.engine import SimGpu
from pdserve.sim.sharing import KINDS, PAIRS, Sharing, _factors, measure

PROFILES = pathlib.Path(__file__).resolve().parents[2] / "bench" / "results" / "profiles"


class _Clock:
    """The simulation's clock and event queue, as SimGpu uses them."""

    def __init__(self):
        self.now, self.events = 0.0, []

    def at(self, t, fn, *args):
        self.events.append((t, fn, args))

    def run(self):
        while self.events:
            self.events.sort(key=lambda e: e[0])
            t, fn, args = self.events.pop(0)
            self.now = t
            fn(*args)


class _Steps:
    """An engine of `steps` steps, each `(seconds alone, kind)`; when each ended, and how long it took."""

    def __init__(self, gpu, steps):
        self.gpu, self.todo, self.ended, self.took = gpu, list(steps), [], []
        self.step_kind = None

    @property
    def has_work(self):
        return bool(self.todo)

    def start_step(self):
        seconds, self.step_kind = self.todo.pop(0)
        return seconds

    def end_step(self, seconds):
        self.ended.append(self.gpu.sim.now)
        self.took.append(seconds)


def test_steps_side_by_side_are_stretched_only_while_they_overlap():
    clock = _Clock()
    gpu = SimGpu(clock, "gpu0", Sharing({(a, b): 2.0 if a == "decode" else 1.5 for a in KINDS for b in KINDS}))
    d = _Steps(gpu, [(1.0, "decode")])
    p = _Steps(gpu, [(1.0, "prefill")])
    gpu.want(d)
    clock.at(0.5, gpu.want, p)  # the prefill starts half-way through the decode step
    clock.run()
    # decode: 0.5 alone, then its 0.5 left at half speed (x2) -> ends at 1.5; prefill from 0.5 to 1.5 at
    # 1/1.5 speed does 2/3 of its work, then its last 1/3 alone -> ends at 1.833
    assert d.ended == pytest.approx([1.5]) and p.ended == pytest.approx([1.5 + 1 / 3])
    assert d.took == pytest.approx([1.5]) and p.took == pytest.approx([4 / 3])
    clock = _Clock()
    turns = SimGpu(clock, "gpu0")  # no sharing measured: whole steps in turn
    d, p = _Steps(turns, [(1.0, "decode")]), _Steps(turns, [(1.0, "prefill")])
    turns.want(d)
    clock.at(0.5, turns.want, p)
    clock.run()
    assert d.ended == [1.0] and p.ended == [2.0]


def test_a_shared_gpu_serves_worse_the_more_its_engines_slow_each_other():
    p = Profile.load(str(PROFILES / "llama3-8b.json"))
    argv = ["--workload", "synthetic", "--input-len", "2048", "--output-len", "64", "--slo-ttft", "1.0",
            "--slo-tpot", "0.04", "--num-requests", "60", "--rates", "6"]
    tpot = {}
    for f in (1.0, 3.0):
        p.sharing = Sharing({(a, b): f for a in KINDS for b in KINDS})
        (run,) = predict(p, "disagg:1:1", argv, one_gpu=True)["runs"]
        assert run["completed"] == 60
        tpot[f] = run["tpot_s"]["mean"]
    assert tpot[3.0] > 1.5 * tpot[1.0]


def test_sharing_is_measured_from_two_engines_in_two_processes(tiny_models, tmp_path):
    """The CPU path of the measurement (the GPU one: bench/profile_gpu.py --sharing): both engines
    start, every pair of step kinds runs side by side, and each factor is a measured ratio; it
    round-trips through a profile."""
    args = dict(model=tiny_models["llama"], max_model_len=256, max_num_batched_tokens=128, max_num_seqs=8)
    s = measure(args, context=64, batch=4, seconds=0.4)
    assert set(s.factors) == {(a, b) for a in KINDS for b in KINDS}
    assert set(s.spread) == {f"{a}|{b}" for a in KINDS for b in KINDS}
    assert all(s.spread[f"{a}|{b}"]["mean"] == f for (a, b), f in s.factors.items())
    assert all(v > 0 for v in s.factors.values()) and all(n > 0 for n in s.steps.values()), s
    assert len(PAIRS) == 5
    prof = Profile.load(str(PROFILES / "llama3-8b.json"))
    prof.sharing = s
    prof.save(str(tmp_path / "p.json"))
    assert Profile.load(str(tmp_path / "p.json")).sharing == s


def test_a_profile_and_its_sharing_are_measured_without_ray():
    """A GPU host that profiles (`pdserve profile`, bench/profile_gpu.py --sharing) need not have
    Ray: the profile and sharing modules do not import it (the simulator, which runs the cluster's
    placement, does, on first use); an H100 host without Ray failed here on the import."""
    import subprocess
    import sys

    code = ("import sys; import pdserve.sim, pdserve.sim.profile, pdserve.sim.sharing, pdserve.sim.profiler; "
            "assert 'ray' not in sys.modules, 'ray imported'; from pdserve.sim import Simulation; "
            "assert 'ray' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_factor_is_the_mean_step_beside_over_the_mean_alone():
    """A time-sliced GPU makes the steps beside the other engine uneven: most a little slower, a few
    waiting out the other's slice. A request's TPOT is the mean of its steps, so the factor is the
    mean's ratio; the median's (which missed the slow steps) and the 90th percentile's are kept."""
    alone = [1.0] * 10
    beside = [1.2] * 8 + [6.0] * 2  # two steps in ten wait out a slice: median 1.2, mean 2.16
    times = {("decode", "idle"): (alone, []), ("prefill", "idle"): ([2.0] * 4, []),
             ("decode", "prefill"): (beside, [4.0] * 4), ("decode", "decode"): (alone, alone),
             ("prefill", "prefill"): ([2.0] * 4, [2.0] * 4)}
    s = _factors(times, "test")
    assert s.factor("decode", "prefill") == pytest.approx(2.16)
    assert s.spread["decode|prefill"] == pytest.approx({"median": 1.2, "mean": 2.16, "p90": 6.0})
    assert s.factor("prefill", "decode") == 2.0 and s.factor("decode", "decode") == 1.0
    assert s.steps == {"decode|prefill": 10, "prefill|decode": 4, "decode|decode": 20, "prefill|prefill": 8}
    assert Sharing.from_json(s.as_json()) == s
