"""configs/monitoring/ for the tests: Debian's Prometheus and promtool (scripts/install_prometheus.sh),
the dashboard's and the rules' PromQL expressions, the metric names an exposition offers, and a
real Prometheus (scripts/start_prometheus.sh) scraping a live router."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from helpers import free_port

ROOT = Path(__file__).resolve().parents[1]
MONITORING = ROOT / "configs" / "monitoring"
NAME = re.compile(r"\b(?:vllm|pdserve):[A-Za-z0-9_]+")
# what Grafana substitutes before a query reaches Prometheus ($role and $model_name: "All")
GRAFANA_VARS = {"$__rate_interval": "30s", "$model_name": ".*", "$role": ".*"}


def prometheus_bin() -> Path | None:
    """The directory of `prometheus` and `promtool`: PDSERVE_PROMETHEUS_BIN (scripts/test.sh sets
    it), else what install_prometheus.sh fetches; None where it cannot (no Debian apt)."""
    if os.environ.get("PDSERVE_PROMETHEUS_BIN"):
        return Path(os.environ["PDSERVE_PROMETHEUS_BIN"])
    r = subprocess.run(["bash", str(ROOT / "scripts" / "install_prometheus.sh")], capture_output=True, text=True)
    return Path(r.stdout.strip()) if r.returncode == 0 else None


def dashboard() -> dict:
    return json.loads((MONITORING / "pdserve-dashboard.json").read_text())


def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title, expression with Grafana's variables substituted) for every target."""
    out = []
    for p in dashboard()["panels"]:
        for t in p.get("targets", []):
            expr = t["expr"]
            for var, value in GRAFANA_VARS.items():
                expr = expr.replace(var, value)
            out.append((p["title"], expr))
    return out


def rule_exprs() -> list[tuple[str, str]]:
    rules = yaml.safe_load((MONITORING / "pdserve-alerts.yml").read_text())
    return [(r["alert"], r["expr"]) for g in rules["groups"] for r in g["rules"]]


def exposition_names(text: str) -> tuple[set[str], set[str]]:
    """(every series name the exposition declares, the names that carry samples now). A family
    with no samples yet (a tier that is off) still declares its names."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    declared, sampled = set(), set()
    for fam in text_string_to_metric_families(text):
        declared |= {fam.name + s for s in suffixes.get(fam.type, ("",))}
        sampled |= {s.name for s in fam.samples}
    return declared | sampled, sampled


class Prometheus:
    """scripts/start_prometheus.sh on a free loopback port, scraping `target` every second."""

    def __init__(self, target: str, data_dir: Path, api_key: str | None = None):
        self.url = f"http://127.0.0.1:{free_port()}"
        env = {**os.environ, **({"PDSERVE_API_KEY": api_key} if api_key else {})}
        self.proc = subprocess.Popen(
            ["bash", str(ROOT / "scripts" / "start_prometheus.sh"), "--target", target, "--listen",
             self.url.removeprefix("http://"), "--dir", str(data_dir), "--scrape-interval", "1s"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def query(self, expr: str) -> dict:
        r = httpx.get(self.url + "/api/v1/query", params={"query": expr}, timeout=10)
        return r.json()

    def wait_scrapes(self, n: int, timeout: float = 60) -> None:
        """Until `n` scrapes of the target succeeded (rate() needs two)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.proc.stderr.read().decode()
            try:
                res = self.query('sum_over_time(up{job="pdserve"}[5m])')["data"]["result"]
                if res and float(res[0]["value"][1]) >= n:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"Prometheus did not scrape {n} times in {timeout} s")

    def rules(self) -> list[dict]:
        groups = httpx.get(self.url + "/api/v1/rules", timeout=10).json()["data"]["groups"]
        return [r for g in groups for r in g["rules"]]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(20)
