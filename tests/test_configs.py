"""Every `ray up` YAML in configs/ passes Ray's own checks (prepare_config, then validate_config)."""

import pathlib

import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

CONFIGS = sorted((pathlib.Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


def test_there_are_configs():
    assert {p.name for p in CONFIGS} >= {"aws.yaml", "onprem.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_ray_accepts_config(path):
    config = prepare_config(yaml.safe_load(path.read_text()))
    validate_config(config)
    if config["provider"]["type"] == "aws":
        types = config["available_node_types"]
        assert types["prefill_gpu"]["resources"] == {"pdserve_prefill": 1}
        assert types["decode_gpu"]["resources"] == {"pdserve_decode": 1}
