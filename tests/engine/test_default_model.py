"""The default model on a cluster of several hosts: the path the router's host resolved names its
own cache; a worker on another host loads that host's copy."""

from __future__ import annotations

import os

import pytest

from pdserve.engine.exec.loader import resolve_model_path


def test_a_worker_on_another_host_loads_its_own_hosts_copy_of_the_default_model(default_model_dir, tmp_path):
    # the head's cache (another home directory): not a path of this host's disk
    theirs = str(tmp_path / "home-of-the-head" / ".cache" / "pdserve" / "models" / os.path.basename(default_model_dir))
    assert resolve_model_path(theirs) == default_model_dir  # was: "model path ... does not exist"
    with pytest.raises(ValueError, match="does not exist"):  # any other missing directory is still refused
        resolve_model_path(str(tmp_path / "models" / "my-model"))
