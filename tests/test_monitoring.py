"""configs/monitoring/: the alert rules pass `promtool check rules` and fire at their thresholds
(`promtool test rules`, Debian's prometheus package); the dashboard is a well-formed Grafana
dashboard. tests/router/test_router.py runs every expression on a real Prometheus scraping a
live router."""

from __future__ import annotations

import re
import subprocess

import pytest

from monitoring import MONITORING, dashboard, dashboard_exprs, prometheus_bin, rule_exprs


@pytest.fixture(scope="module")
def promtool():
    bin_dir = prometheus_bin()
    if bin_dir is None:
        pytest.skip("no Debian apt to fetch prometheus (scripts/test.sh installs it)")
    return str(bin_dir / "promtool")


def test_rules_pass_promtool_check(promtool):
    r = subprocess.run([promtool, "check", "rules", "pdserve-alerts.yml"], cwd=MONITORING, capture_output=True,
                       text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(rule_exprs())} rules found" in r.stdout


def test_alerts_fire_at_their_thresholds(promtool):
    """KV usage 90% -> pushing after 5 min, 97% -> thrashing after 10, 80% neither; 2% preemptions
    per request fire, 0.5% do not; an empty pool, a backlog, 429s (pdserve-alerts.test.yml)."""
    r = subprocess.run([promtool, "test", "rules", "pdserve-alerts.test.yml"], cwd=MONITORING,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    tested = set(re.findall(r"alertname: (\w+)", (MONITORING / "pdserve-alerts.test.yml").read_text()))
    assert tested == {name for name, _ in rule_exprs()}  # every alert has a unit test


def test_dashboard_is_well_formed():
    d = dashboard()
    panels = d["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    variables = {v["name"] for v in d["templating"]["list"]}
    cells = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        mine = {(g["x"] + i, g["y"] + j) for i in range(g["w"]) for j in range(g["h"])}
        assert not cells & mine, f"{p['title']} overlaps another panel"
        cells |= mine
        if p["type"] == "row":
            continue
        assert p["targets"] and p["datasource"]["uid"] == "${datasource}", p["title"]
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"]), p["title"]
        for t in p["targets"]:
            used = set(re.findall(r"\$(?!__)(\w+)", t["expr"]))
            assert used <= variables, (p["title"], used - variables)
    for title, expr in dashboard_exprs():
        assert "$" not in expr, (title, expr)  # every variable has a test substitute
