"""A cluster of three hosts (tests/hostbed.py: each its own network, mount and PID namespaces, its
own address) with Ray's token auth on: h1 runs the Ray head and `pdserve serve --address`, h2
offers `pdserve_prefill`, h3 `pdserve_decode`. KV moves between h2 and h3 over gloo at their own
addresses; the client is this machine, reaching the router at h1's address. Tests of the same pools
share one server (`servers`), in the order that starts each mode once: 115 s alone, was 240 s."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from hostbed import HostBed, wait_for

from pdserve.cluster.registry.registry import REGISTRY_NAME

from helpers import hf_greedy, save_tiny

pytestmark = pytest.mark.slow

RAY_PORT = 6379
PORT = 8000
PROMPTS = [[1, 504, 3100, 17, 900, 28, 77, 4021, 33, 12, 5, 9, 871, 2890, 45, 6, 700, 31, 18, 2],
           [1, 22, 3333, 4444, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34]]
MAX_TOKENS = 6


def _get(url: str, key: str | None = None, timeout: float = 10) -> dict:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _post(url: str, body: dict, timeout: float = 120, headers: dict | None = None) -> dict:
    """The JSON answer; `headers`, if given, gets the response's headers."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            if headers is not None:
                headers.update({k.lower(): v for k, v in r.headers.items()})
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise AssertionError(f"{url}: {e.code} {e.read().decode()[:500]}") from None


def _up(url: str) -> bool:
    try:
        return _get(f"{url}/health", timeout=3).get("status") == "ok"
    except OSError:
        return False


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, tok_dir):
    """The bed, its Ray (token auth on), and the tiny model where every host reads it."""
    with HostBed(3) as bed:
        model = save_tiny("llama", os.path.join(bed.shared_dir(), "llama"), tok_dir)
        env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
               "RAY_worker_niceness": "0"}  # as docs/deployment.md says to start Ray
        env.pop("GLOO_SOCKET_IFNAME", None)  # what a user's hosts have: nothing set
        bed.popen("h1", *RAY_START, "--head", f"--port={RAY_PORT}", f"--node-ip-address={bed.addr['h1']}",
                  "--num-cpus=1", "--include-dashboard=false", env=env, stdout=subprocess.DEVNULL,
                  stderr=subprocess.DEVNULL)
        for host in ("h2", "h3"):
            _join(bed, env, host)
        wait_for(lambda: _alive_nodes(bed, env) == 3, 120, "three Ray nodes")
        yield bed, env, model


RAY_START = [sys.executable, "-m", "ray.scripts.scripts", "start", "--block", "--disable-usage-stats"]
ROLE_OF = {"h2": "prefill", "h3": "decode"}


def _join(bed: HostBed, env: dict, host: str) -> None:
    """`host` joins the head's Ray, offering its pool's resource; pdserve_any: one worker of a pool
    that may run on either (the colocated test's)."""
    resources = json.dumps({f"pdserve_{ROLE_OF[host]}": 4, "pdserve_any": 1})
    bed.popen(host, *RAY_START, f"--address={bed.addr['h1']}:{RAY_PORT}", f"--node-ip-address={bed.addr[host]}",
              "--num-cpus=4", f"--resources={resources}", env=env, stdout=subprocess.DEVNULL,
              stderr=subprocess.DEVNULL)


def _alive_nodes(bed: HostBed, env: dict) -> int:
    count = (f"import ray; ray.init(address='{bed.addr['h1']}:{RAY_PORT}', logging_level='ERROR'); "
             "print(sum(n['Alive'] for n in ray.nodes()))")
    out = bed.run("h1", sys.executable, "-c", count, env=env, timeout=60).stdout.strip()
    return int(out) if out.isdigit() else -1


class Servers:
    """One `pdserve serve` on h1 at a time, shared by the tests that run the same pools (one prefill and
    one decode worker, in one mode): a start and stop is ~20 s of the bed's time, six tests made
    six. A test asks `get(mode)`; a server of another mode is stopped first. Tests that share one
    leave it serving (each fault test waits until it serves again and its blocks are back) and
    check the log it wrote while they ran (`log_since`)."""

    def __init__(self, bed: HostBed, env: dict, model: str):
        self.bed, self.env, self.model = bed, env, model
        self.proc: subprocess.Popen | None = None
        self.mode: str | None = None

    def get(self, mode: str) -> tuple[subprocess.Popen, str]:
        if self.mode != mode:
            self.stop()
            self.proc, self.url = _serve(self.bed, self.env, self.model, "--mode", mode, "--prefill", "1",
                                         "--decode", "1")
            self.mode = mode
        return self.proc, self.url

    def stop(self) -> None:
        if self.proc is not None:
            err, self.proc, self.mode = _stop(self.bed, self.proc), None, None
            assert "Traceback" not in err, err[-3000:]


@pytest.fixture(scope="module")
def servers(cluster):
    bed, env, model = cluster
    s = Servers(bed, env, model)
    yield s
    s.stop()


def log_since(proc: subprocess.Popen, mark: int) -> str:
    """What the server wrote after `mark` (a length of its log)."""
    return _log(proc)[mark:]


def _serve(bed: HostBed, env: dict, model: str, *args: str) -> tuple[subprocess.Popen, str]:
    url = f"http://{bed.addr['h1']}:{PORT}"
    # its log to a file, not a pipe read at the end: a fault test's warnings could fill a pipe and stall it
    log = open(os.path.join(bed.shared_dir(), f"serve-{time.monotonic_ns()}.log"), "a+")  # appends whatever the offset
    proc = bed.popen("h1", sys.executable, "-m", "pdserve", "serve", "--address", f"{bed.addr['h1']}:{RAY_PORT}",
                     "--host", bed.addr["h1"], "--port", str(PORT), "--model", model, "--max-model-len", "128",
                     *args, env=env, stdout=subprocess.DEVNULL, stderr=log)
    proc.log = log
    deadline = time.monotonic() + 240
    while not _up(url):
        assert proc.poll() is None, _log(proc)[-3000:]
        assert time.monotonic() < deadline, "pdserve serve did not become healthy in 240 s"
        time.sleep(1)
    return proc, url


def _stop(bed: HostBed, proc: subprocess.Popen) -> str:
    """Ctrl-C to the server (the process nsenter started in h1)."""
    import signal

    bed.signal(proc, signal.SIGINT)
    try:
        proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    return _log(proc)


def _log(proc: subprocess.Popen) -> str:
    """What the server wrote to stderr so far."""
    proc.log.flush()
    proc.log.seek(0)
    return proc.log.read()


def _all_blocks_back(url: str, within_s: float = 30) -> None:
    """Every worker's KV blocks free and nothing running, within `within_s` of the load's end."""
    rows: list = []

    def idle() -> bool:
        rows[:] = _get(f"{url}/admin/status")["workers"]
        return all(w.get("kv_blocks_used", 0) == 0 and w.get("num_running", 0) == 0 for w in rows)

    try:
        wait_for(idle, within_s, "KV blocks back to 0")
    except AssertionError:
        keys = ("worker_id", "role", "kv_blocks_used", "num_running", "num_waiting", "error")
        raise AssertionError(f"KV blocks not back to 0 in {within_s:.0f} s: "
                             f"{[{k: w.get(k) for k in keys} for w in rows]}") from None


def _complete(url: str, prompt: list[int], headers: dict | None = None) -> dict:
    name = _get(f"{url}/v1/models")["data"][0]["id"]
    return _post(f"{url}/v1/completions", {"model": name, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                           "temperature": 0, "ignore_eos": True, "return_token_ids": True},
                 headers=headers)


def _degraded_for(url: str, seconds: float) -> bool:
    """Polls /health each second for `seconds`: whether it ever said anything but ok (a 503 when a
    pool it needs is empty)."""
    t, degraded = time.monotonic(), False
    while time.monotonic() - t < seconds:
        try:
            degraded |= _get(f"{url}/health", timeout=5)["status"] != "ok"
        except (OSError, ValueError):
            degraded = True
        time.sleep(1)
    return degraded


def _rejoin_and_serve(bed: HostBed, env: dict, url: str, load: Load, host: str) -> tuple[float, dict, dict]:
    """`host` rejoins Ray after a fault; then: seconds until every client is served again (bound
    120 s), the load's outcomes, the KV blocks back to 0, and the workers of the host's pool
    (id -> node address)."""
    _join(bed, env, host)
    wait_for(lambda: _alive_nodes(bed, env) == 3, 60, f"{host}'s Ray back")
    healed_s = load.served_again(url, f"a {ROLE_OF[host]} worker serving again on {host}", within_s=120)
    outcomes = load.finish()
    _all_blocks_back(url)
    return healed_s, outcomes, {wid: node for wid, (role, node) in _nodes(url).items() if role == ROLE_OF[host]}


def _nodes(url: str) -> dict[str, tuple[str, str]]:
    """worker id -> (pool, node address)."""
    return {w["worker_id"]: (w["role"], w["node"]) for w in _get(f"{url}/admin/status")["workers"]}


def _under_load(servers: Servers, mode: str) -> tuple[subprocess.Popen, str, Load, int]:
    """The shared server of one prefill and one decode worker in `mode`, with Load's clients running
    on it, and the length of its log before the load."""
    proc, url = servers.get(mode)
    mark = len(_log(proc))
    load = Load(url, _get(f"{url}/v1/models")["data"][0]["id"])
    wait_for(lambda: load.ok_since(0) >= 8, 60, "the load running")
    return proc, url, load, mark


class Load:
    """Clients that send requests until stopped, half of them streaming; each request's outcome:
    ok (its tokens kept), error-after-tokens, 503 (with its Retry-After), other HTTP errors, or
    hung (no answer within `timeout_s`)."""

    def __init__(self, url: str, name: str, clients: int = 4, timeout_s: float = 60):
        import threading

        self.url, self.name, self.timeout_s = url, name, timeout_s
        self.rows: list[tuple[float, list[int], str, list[int], float]] = []  # (start, prompt, outcome, tokens, s)
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._client, args=(k, k % 2 == 1), daemon=True)
                        for k in range(clients)]
        for t in self.threads:
            t.start()

    def _one(self, prompt: list[int], stream: bool) -> tuple[str, list[int]]:
        import httpx

        body = {"model": self.name, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True, "stream": stream}
        try:
            with httpx.Client(timeout=self.timeout_s) as c:
                if not stream:
                    r = c.post(f"{self.url}/v1/completions", json=body)
                    if r.status_code == 503:
                        return ("503" if r.headers.get("retry-after") else "503-no-retry-after"), []
                    if r.status_code != 200:
                        return f"http {r.status_code}", []
                    return "ok", r.json()["choices"][0]["token_ids"]
                tokens = []
                with c.stream("POST", f"{self.url}/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        r.read()
                        return ("503" if r.status_code == 503 and r.headers.get("retry-after")
                                else f"http {r.status_code}"), []
                    for line in r.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        event = json.loads(line[6:])
                        if "error" in event:
                            return ("error-after-tokens" if tokens else "error-event"), tokens
                        tokens += event["choices"][0].get("token_ids") or []
                return "ok", tokens
        except httpx.TimeoutException:
            return "hung", []
        except httpx.HTTPError as e:
            return f"transport {type(e).__name__}", []

    def _client(self, k: int, stream: bool) -> None:
        i = 0
        while not self.stop.is_set():
            i += 1
            prompt = [1, 200 + k, 300 + i % 8, *range(600, 616)]
            t0 = time.monotonic()
            outcome, tokens = self._one(prompt, stream)
            self.rows.append((t0, prompt, outcome, tokens, time.monotonic() - t0))
            if outcome != "ok":
                time.sleep(0.5)  # what a client told to retry does

    def served_again(self, url: str, what: str, within_s: float = 30) -> float:
        """Seconds until every client is served again (4 answers in the last 3 s, /health ok)."""
        t = time.monotonic()
        try:
            wait_for(lambda: self.ok_since(time.monotonic() - 3) >= 4 and _up(url), within_s, what)
        except AssertionError as e:  # what it saw: the outcomes since and the server's health
            since = [(round(t0 - t, 1), o, round(s, 1)) for t0, _, o, _, s in self.rows if t0 + s >= t]
            try:
                health = _get(f"{url}/health", timeout=3)
            except OSError as h:
                health = repr(h)
            raise AssertionError(f"{e}; requests since (sent s, outcome, took s): {since}; /health: {health}") from None
        return time.monotonic() - t

    def ok_since(self, t: float) -> int:
        return sum(1 for t0, _, o, _, _ in self.rows if t0 >= t and o == "ok")

    def finish(self) -> dict[str, int]:
        self.stop.set()
        for t in self.threads:
            t.join(self.timeout_s + 10)
        import collections

        return dict(collections.Counter(o for _, _, o, _, _ in self.rows))

    def exact(self, model: str) -> bool:
        """Every answered request's tokens equal Hugging Face's for its prompt."""
        oks = [(tuple(p), t) for _, p, o, t, _ in self.rows if o == "ok"]
        prompts = sorted({p for p, _ in oks})
        want = dict(zip(prompts, hf_greedy(model, [list(p) for p in prompts], MAX_TOKENS)))
        return all(t == want[p] for p, t in oks)


def test_disagg_across_hosts_hands_kv_over_the_network_and_matches_hugging_face(cluster, servers):
    """Prefill on h2, decode on h3 (the block registry on h1, the router's host): each pair binds and
    announces its node's address (gloo, never loopback), the tokens equal Hugging Face's, and
    /admin/status names both ends of the link."""
    bed, env, model = cluster
    proc, url = servers.get("disagg")
    mark = len(_log(proc))
    name = _get(f"{url}/v1/models")["data"][0]["id"]
    body = {"model": name, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    outs = [_post(f"{url}/v1/completions", {**body, "prompt": p}) for p in PROMPTS]
    status = _get(f"{url}/admin/status")
    listening = {h: bed.run(h, "ss", "-ltnH").stdout for h in ("h2", "h3")}  # what each host listens on
    err = log_since(proc, mark)
    assert [o["choices"][0]["token_ids"] for o in outs] == hf_greedy(model, PROMPTS, MAX_TOKENS), outs
    nodes = {w["role"]: w["node"] for w in status["workers"]}
    assert nodes == {"prefill": bed.addr["h2"], "decode": bed.addr["h3"]}, status["workers"]
    assert status["registry"]["node"] == bed.addr["h1"], status["registry"]
    # and Ray runs it there: its process, found by the pid it answers with, is one of h1's
    ask = (f"import ray; ray.init(address='{bed.addr['h1']}:{RAY_PORT}', logging_level='ERROR'); "
           f"print(ray.get(ray.get_actor('{REGISTRY_NAME}', namespace='pdserve').ping.remote(), timeout=30))")
    pid = bed.run("h1", sys.executable, "-c", ask, env=env, timeout=60).stdout.split()[-1]
    assert "BlockRegistry" in bed.run("h1", "cat", f"/proc/{pid}/cmdline").stdout, pid
    links = [link for w in status["workers"] for link in (w.get("kv_links") or {}).values()]
    assert links, status
    for link in links:
        assert link["link"] == "gloo", link
        ends = {link["local"].rsplit(":", 1)[0], link["peer"].rsplit(":", 1)[0]}
        assert ends == {bed.addr["h2"], bed.addr["h3"]}, link
        # the KV store of each end listens on its node's address, and there only
        host = next(h for h in ("h2", "h3") if link["local"].startswith(bed.addr[h] + ":"))
        port = link["local"].rsplit(":", 1)[1]
        binds = [row.split()[3] for row in listening[host].splitlines() if row.split()[3].endswith(":" + port)]
        assert binds == [link["local"]], (link, listening[host])
    assert "Traceback" not in err, err[-3000:]


def test_a_decode_hosts_link_down_for_20_s_under_load_fails_nothing_silently_and_heals(cluster, servers):
    """Disagg across hosts under streaming and non-streaming load; h3 (decode) loses its link for
    20 s. No request hangs past its timeout; each one is answered with Hugging Face's tokens, or
    503 with Retry-After; /health says degraded while the decode host is away; every client is
    served again after the link's return, with no restart (goal 30 s, bound 60 s); the KV blocks are all back
    once the load stops."""
    bed, env, model = cluster
    proc, url, load, mark = _under_load(servers, "disagg")
    try:
        bed.link("h3", up=False)
        degraded = _degraded_for(url, 20)
        bed.link("h3", up=True)
        # the goal is 30 s (printed below): measured 11 and 20 s, once over 30 s. What sets it is Ray's own
        # reconnect to the host (its gRPC backoff), not pdserve's placement; the test fails past twice that
        healed_s = load.served_again(url, "full strength again", within_s=60)
        outcomes = load.finish()
        _all_blocks_back(url)
    finally:
        load.finish()
        err = log_since(proc, mark)
    assert degraded, "/health said ok while the decode host was away"
    assert set(outcomes) <= {"ok", "503"}, (outcomes, err[-3000:])
    assert load.exact(model), "a wrong token"
    print(f"link down 20 s: {outcomes}, served again {healed_s:.1f} s after the link's return")


def test_disagg_hands_kv_over_a_link_of_100_ms_and_1_percent_loss_under_load(cluster, servers):
    """Disagg under load while h3's (decode) link holds every frame 100 ms each way and drops 1% of
    them (hosts.sh impair: netem's delay and loss, relayed in user space; this kernel has no
    sch_netem): the handoffs over it complete (TCP resends what is lost) and the requests are
    answered ok with Hugging Face's tokens, none retried, none hung; mended, every client is served
    again at once, and the KV blocks are all back."""
    bed, env, model = cluster
    proc, url, load, mark = _under_load(servers, "disagg")
    retries = _get(f"{url}/admin/status")["requests"]["retries"]
    try:
        bed.impair("h3", 100, 0.01)
        t_imp = time.monotonic()
        wait_for(lambda: load.ok_since(t_imp + 1) >= 16, 120, "16 requests served over the impaired link")
        slow = [s for t0, _, o, _, s in load.rows if t0 >= t_imp + 1 and o == "ok"]
        bed.mend("h3")
        healed_s = load.served_again(url, "full strength again")
        outcomes = load.finish()
        _all_blocks_back(url)
    finally:
        load.finish()
        bed.mend("h3")
        err = log_since(proc, mark)
    assert set(outcomes) == {"ok"}, (outcomes, err[-3000:])
    assert _get(f"{url}/admin/status")["requests"]["retries"] == retries, err[-3000:]
    before = sorted(s for t0, _, o, _, s in load.rows if t0 < t_imp and o == "ok")
    slow.sort()
    # the delay was there: a request crosses h3's link both ways (its handoff, its tokens), 200 ms at least
    assert slow[len(slow) // 2] > before[len(before) // 2] + 0.2, (before, slow)
    assert load.exact(model), "a wrong token"
    print(f"100 ms + 1% loss on the decode host's link: {outcomes}, requests took {slow[0]:.2f}-{slow[-1]:.2f} s "
          f"(median {slow[len(slow) // 2]:.2f}; {before[len(before) // 2]:.2f} before), served again {healed_s:.1f} s "
          "after mending")


def test_disagg_answers_503_at_once_through_a_partition_and_takes_the_pair_back_after(cluster, servers):
    """Disagg under load while h2 (prefill) and h3 (decode) cannot reach each other for 15 s, both
    still reaching the head. A prompt whose decode worker's reservation does not come asks whether
    that host answers (transfer/probe.py): it does not, so the attempt fails in seconds, the pair is
    out of placement (placement.LINK_DOWN_S) and requests get 503 + Retry-After, not a wait of the
    handoff timeout; /health says degraded and names the link. Nothing hangs, no token is wrong,
    the pair serves again within 30 s of the partition's end (the prefill worker's probe of the
    link takes it back at the monitor's next pass: Dispatcher.check_links), the KV blocks are all
    back."""
    from pdserve.cluster.placement.placement import LINK_DOWN_S
    from pdserve.transfer.probe import PROBE_S, STALL_S

    bed, env, model = cluster
    proc, url, load, mark = _under_load(servers, "disagg")
    try:
        bed.partition("h2", "h3")
        t_cut, named = time.monotonic(), set()
        while time.monotonic() - t_cut < 15:
            try:  # 200 "degraded": both pools have their worker
                named |= set(_get(f"{url}/health", timeout=5).get("kv_links_down", {}))
            except (OSError, ValueError):
                pass
            time.sleep(1)
        bed.partition("h2", "h3", cut=False)
        healed_s = load.served_again(url, "the pair serving again")
        outcomes = load.finish()
        _all_blocks_back(url)
    finally:
        load.finish()
        err = log_since(proc, mark)
    assert set(outcomes) <= {"ok", "503"} and outcomes.get("503"), (outcomes, err[-3000:])
    # while the pair is out of placement (from the first refusal for LINK_DOWN_S; then one attempt tries
    # it again, by design, and one sent in the cut's last seconds may wait for the link's return: CI
    # saw requests sent 13.3 s into the cut served after 30 s, the pair marked down ~3 s in)
    down_until = min(t0 + s for t0, _, o, _, s in load.rows if t0 >= t_cut and o == "503") + LINK_DOWN_S - 1
    window = (t_cut + 1, min(t_cut + 14, down_until))
    cut = [(o, s) for t0, _, o, _, s in load.rows if window[0] <= t0 < window[1]]
    served = [(round(t0 - t_cut, 2), len(p), o, n, round(s, 2)) for t0, p, o, n, s in load.rows
              if window[0] <= t0 < window[1] and o != "503"]  # (sent after the cut, prompt, outcome, tokens, s)
    assert cut and not served, (served, err[-3000:])  # while cut: refused, none served half-way
    # the first refusal came within a stall and a probe (and an engine step), not the handoff timeout
    assert min(s for o, s in cut) < STALL_S + PROBE_S + 2, cut
    assert named, "/health never named the link that was down"
    assert load.exact(model), "a wrong token"
    print(f"partition 15 s (disagg): {outcomes}, served again {healed_s:.1f} s after")


def test_a_prefill_host_killed_whole_under_load_is_a_503_until_it_is_back_and_serves_again(cluster, servers):
    """Disagg under load; h2, the only prefill host, loses its power (hosts.sh crash: its link down,
    every process of it killed). While it is gone no request hangs past its timeout: each is answered
    with Hugging Face's tokens or 503 + Retry-After, and /health says degraded. 20 s later the host
    boots and rejoins Ray; the monitor's refill, which waited for a node offering the prefill pool
    without holding up the monitor, starts a prefill worker there, and every client is served again
    with no restart of the server (goal 30 s after the host's Ray is back, bound 120 s); the KV blocks
    are all back."""
    bed, env, model = cluster
    proc, url, load, mark = _under_load(servers, "disagg")
    before = {wid for wid, (role, _) in _nodes(url).items() if role == "prefill"}
    try:
        bed.crash("h2")
        degraded = _degraded_for(url, 20)
        bed.boot("h2")
        healed_s, outcomes, after = _rejoin_and_serve(bed, env, url, load, "h2")
    finally:
        load.finish()
        err = log_since(proc, mark)
    assert degraded, "/health said ok while the prefill host was gone"
    assert set(outcomes) <= {"ok", "503"}, (outcomes, err[-3000:])
    assert outcomes.get("503"), outcomes  # refused while no prefill worker could be placed on
    assert load.exact(model), "a wrong token"
    assert len(after) == 1 and not set(after) & before and set(after.values()) == {bed.addr["h2"]}, after
    print(f"prefill host killed, back after 20 s: {outcomes}, served again {healed_s:.1f} s after its Ray was")


def test_a_decode_hosts_raylet_lost_under_load_is_replaced_there_once_its_ray_is_back(cluster, servers):
    """Disagg under load; the raylet of h3 (the decode host) is killed, the host itself stays: Ray's
    worker processes there end with it, so the decode worker is gone for the router. No request
    hangs past its timeout; each is answered with Hugging Face's tokens, 503 + Retry-After, or (a
    stream whose worker died after its first tokens) an error event; /health says degraded. Once
    h3's Ray is started again, a new decode worker serves there (goal 30 s, bound 120 s), with no
    restart of the server; the KV blocks are all back."""
    bed, env, model = cluster
    proc, url, load, mark = _under_load(servers, "disagg")
    before = {wid for wid, (role, _) in _nodes(url).items() if role == "decode"}
    try:
        raylet = bed.python("h3", "import os\nfor p in os.listdir('/proc'):\n    if p.isdigit():\n"
                                  "        try: c = open(f'/proc/{p}/comm').read().strip()\n"
                                  "        except OSError: continue\n"
                                  "        if c == 'raylet': print(p)").split()
        assert len(raylet) == 1, raylet
        bed.run("h3", "kill", "-9", raylet[0])
        degraded = _degraded_for(url, 15)
        wait_for(lambda: _alive_nodes(bed, env) == 2, 60, "h3's node dead to Ray")
        healed_s, outcomes, after = _rejoin_and_serve(bed, env, url, load, "h3")
    finally:
        load.finish()
        err = log_since(proc, mark)
    assert degraded, "/health said ok while the decode worker was gone"
    assert set(outcomes) <= {"ok", "503", "error-after-tokens"}, (outcomes, err[-3000:])
    assert load.exact(model), "a wrong token"
    assert len(after) == 1 and not set(after) & before and set(after.values()) == {bed.addr["h3"]}, after
    print(f"decode host's raylet killed: {outcomes}, served again {healed_s:.1f} s after its Ray was back")


def test_a_process_without_the_clusters_token_cannot_join_it(cluster):
    """From a host of the bed, Ray's token auth turns away a driver with a wrong token and one with
    auth off: neither joins the cluster, so neither can submit work to it."""
    bed, env, _ = cluster
    join = f"import ray; ray.init(address='{bed.addr['h1']}:{RAY_PORT}'); print('joined')"
    # Ray's driver asks the GCS RAY_NUM_REDIS_GET_RETRIES times a second apart (20 by default) before it
    # gives up; a refused token is refused the same on the first: 3 tries keep 34 s of the test's 41 s
    tries = {"RAY_NUM_REDIS_GET_RETRIES": "3"}
    for auth in ({"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64}, {"RAY_AUTH_MODE": "disabled"}):
        out = bed.run("h2", sys.executable, "-c", join, env={**env, **auth, **tries}, timeout=120)
        assert out.returncode != 0 and "joined" not in out.stdout, (auth, out.stdout, out.stderr[-2000:])
        assert "token" in out.stderr.lower(), out.stderr[-2000:]


def test_nccl_and_gloo_pick_the_interface_of_the_nodes_address(cluster):
    """On a host whose address is on eth0 (and 127.0.0.1 on lo), NCCL's sockets are pointed at the
    interface that holds the node's address, exactly ('=eth0'); a user's NCCL_SOCKET_IFNAME stays;
    an address no interface holds changes nothing. (The GPU kinds lent here are single-host: this
    is the choice NCCL gets, checked on CPU.)"""
    bed, env, _ = cluster
    code = ("import os; from pdserve.engine.base.stores import interface_of, nccl_interface\n"
            f"print(interface_of('{bed.addr['h2']}'), interface_of('127.0.0.1'), interface_of('10.255.255.254'))\n"
            f"print(nccl_interface('{bed.addr['h2']}'))\n"
            "os.environ['NCCL_SOCKET_IFNAME'] = 'ib0'\n"
            f"print(nccl_interface('{bed.addr['h2']}'))\n")
    clean = {k: v for k, v in env.items() if k != "NCCL_SOCKET_IFNAME"}
    assert bed.python("h2", code, env=clean).split("\n")[:3] == ["eth0 lo None", "=eth0", "ib0"]


def test_hybrid_across_hosts_scales_decode_onto_the_host_that_offers_it_and_drains_it_back(cluster, servers):
    """Hybrid with its pools on two hosts answers Hugging Face's tokens; `scale --decode 2` starts
    the new worker on the host that offers decode (h3), which serves; the shrink back drains one."""
    bed, env, model = cluster
    proc, url = servers.get("hybrid")
    mark = len(_log(proc))
    want = hf_greedy(model, PROMPTS, MAX_TOKENS)
    assert [_complete(url, p)["choices"][0]["token_ids"] for p in PROMPTS] == want
    assert _post(f"{url}/admin/scale", {"decode": 2})["pools"]["decode"] == 2
    wait_for(lambda: len(_nodes(url)) == 3, 120, "the second decode worker")
    nodes = _nodes(url)
    assert sorted(nodes.values()) == [("decode", bed.addr["h3"])] * 2 + [("prefill", bed.addr["h2"])], nodes
    # both decode workers serve twelve requests at once (placement weighs each one's load:
    # what it was given and has not finished), the tokens still exact
    prompts = [[1, 300 + 97 * i, *range(500 + i, 520 + i)] for i in range(12)]
    heads = [{} for _ in prompts]
    with ThreadPoolExecutor(12) as ex:
        outs = list(ex.map(lambda i: _complete(url, prompts[i], headers=heads[i]), range(12)))
    assert [o["choices"][0]["token_ids"] for o in outs] == hf_greedy(model, prompts, MAX_TOKENS)
    served = {h["x-pdserve-decode"] for h in heads}
    assert served == {w for w, (role, _) in nodes.items() if role == "decode"}, served
    assert _post(f"{url}/admin/scale", {"decode": 1})["pools"]["decode"] == 1
    wait_for(lambda: len(_nodes(url)) == 2, 120, "the drained decode worker gone")
    assert [_complete(url, p)["choices"][0]["token_ids"] for p in PROMPTS] == want
    err = log_since(proc, mark)
    assert "Traceback" not in err, err[-3000:]


def test_hybrid_serves_on_the_decode_host_through_a_partition_between_prefill_and_decode(cluster, servers):
    """Hybrid under load while h2 (prefill) and h3 (decode) cannot reach each other for 15 s, both
    still reaching the head: every request is answered with Hugging Face's tokens (prompts are
    prefilled where they are decoded while no KV can cross), none hangs past its timeout, and the
    KV blocks are all back once the load stops."""
    bed, env, model = cluster
    proc, url, load, mark = _under_load(servers, "hybrid")
    try:
        bed.partition("h2", "h3")
        t_cut = time.monotonic()
        time.sleep(15)
        during = load.ok_since(t_cut)
        bed.partition("h2", "h3", cut=False)
        time.sleep(3)
        outcomes = load.finish()
        _all_blocks_back(url)
    finally:
        load.finish()
        err = log_since(proc, mark)
    assert set(outcomes) == {"ok"}, (outcomes, err[-3000:])
    assert during >= 8, f"only {during} requests served during the partition"
    assert load.exact(model), "a wrong token"
    print(f"partition 15 s (hybrid): {outcomes}, {during} served during it")


def test_colocated_across_hosts_routes_a_prefix_to_the_host_that_holds_it(cluster, servers):
    """Two colocated workers, one per host (h2, h3): a prompt that shares a cached prefix goes to
    the worker (and host) that holds it, which reports the hit; tokens equal Hugging Face's."""
    bed, env, model = cluster
    servers.stop()  # one server at a time on h1's port
    config = os.path.join(bed.shared_dir(), "colocated.yaml")
    with open(config, "w") as f:
        f.write("decode: {replicas: 2, min: 1, max: 2, resources: {pdserve_any: 1}}\n")
    proc, url = _serve(bed, env, model, "--mode", "colocated", "--config", config)
    try:
        nodes = _nodes(url)
        assert sorted(n for _, n in nodes.values()) == sorted([bed.addr["h2"], bed.addr["h3"]]), nodes
        base = list(range(100, 164))  # four blocks
        h1, h2 = {}, {}
        first = _complete(url, base + [7], headers=h1)
        again = _complete(url, base + [8, 9], headers=h2)
        assert h2["x-pdserve-decode"] == h1["x-pdserve-decode"] in nodes, (h1, h2, nodes)  # the holder
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 48, again["usage"]
        assert [first["choices"][0]["token_ids"], again["choices"][0]["token_ids"]] == \
            hf_greedy(model, [base + [7], base + [8, 9]], MAX_TOKENS)
    finally:
        err = _stop(bed, proc)
    assert "Traceback" not in err, err[-3000:]
