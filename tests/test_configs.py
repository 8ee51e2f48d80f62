"""Every `ray up` YAML in configs/ passes Ray's own checks (prepare_config, then
validate_config); every serving config in configs/serving/ loads and validates."""

import pathlib

import pytest
import yaml
from ray.autoscaler._private import providers
from ray.autoscaler._private.util import prepare_config, validate_config

from pdserve.cluster.spec.serving_config import ServingConfig

CONFIGS = sorted((pathlib.Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


def test_there_are_configs():
    assert {p.name for p in CONFIGS} >= {"aws.yaml", "onprem.yaml", "fake_multinode.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_ray_accepts_config(path, monkeypatch):
    raw = yaml.safe_load(path.read_text())
    if raw["provider"]["type"] == "fake_multinode":
        # the pip wheel lacks the provider's defaults file (example.yaml) that prepare_config
        # merges in; our config is complete, so it serves as its own defaults
        monkeypatch.setitem(providers._DEFAULT_CONFIGS, "fake_multinode", lambda: str(path))
    config = prepare_config(yaml.safe_load(path.read_text()))
    validate_config(config)
    if config["provider"]["type"] == "aws":
        types = config["available_node_types"]
        assert types["prefill_gpu"]["resources"] == {"pdserve_prefill": 1}
        assert types["decode_gpu"]["resources"] == {"pdserve_decode": 1}


@pytest.mark.parametrize("path", sorted((CONFIGS[0].parent / "serving").glob("*.yaml")), ids=lambda p: p.name)
def test_serving_config_loads(path):
    cfg = ServingConfig.from_yaml(str(path))
    for role in ("prefill", "decode"):
        assert cfg.pool(role).resources == {f"pdserve_{role}": 1}


def test_serving_config_errors_name_the_problem(tmp_path):
    bad = tmp_path / "bad.yaml"
    for text, words in [("decode: {min: 3, max: 2}", "min <= max"), ("autoscale: {kv_usage: 1.5}", "kv_usage"),
                        ("prefill: {replica: 2}", "unknown prefill keys"), ("- 1", "is a mapping"),
                        ("decode: {resources: {pdserve_decode: 0}}", "positive amount"),
                        ("handoff: {peer_fetch: sometimes}", "handoff.peer_fetch must be true or false")]:
        bad.write_text(text)
        with pytest.raises(ValueError, match=words):
            ServingConfig.from_yaml(str(bad))


@pytest.mark.parametrize("path", [p for p in CONFIGS if p.name in ("aws.yaml", "onprem.yaml")], ids=lambda p: p.name)
def test_deployments_are_closed(path):
    """Ray's token auth on every node, its workers at nice 0 (Ray's 15 starves the serving workers
    beside any busy process), nothing on 0.0.0.0, the router started with its keys."""
    raw = yaml.safe_load(path.read_text())
    commands = raw["head_start_ray_commands"] + raw["worker_start_ray_commands"]
    assert "0.0.0.0" not in path.read_text() and "RAY_AUTH_MODE=disabled" not in path.read_text()
    starts = [c for c in commands if "ray start" in c or "pdserve join" in c]
    assert len(starts) >= 2 and all("RAY_AUTH_MODE=token" in c for c in starts)
    # `pdserve join` gives its `ray start` the same (cluster/health/worker_host.py)
    assert all("RAY_worker_niceness=0" in c for c in commands if "ray start" in c)
    (serve,) = [c for c in commands if "pdserve serve" in c]
    assert ". ~/.pdserve/keys.env" in serve and "--host $(hostname -I" in serve
    assert any("PDSERVE_ADMIN_KEY" in c and "PDSERVE_API_KEY" in c for c in commands)
    assert raw["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
