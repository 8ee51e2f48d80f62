"""`ray up` of configs/onprem.yaml on a bed of three hosts, as a user runs it: Ray's local
provider logs into each host over SSH (an sshd on each host's address, a key the test makes),
copies a checkout and Ray's auth token, runs the setup and start commands (token auth on), and
the head starts `pdserve serve --address auto`; a completion through the router at the head's
address with the key the head made; `ray down` then leaves no process on any host within
seconds (the worker hosts' `pdserve join`)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml
from hostbed import HostBed, wait_for

from pdserve.cluster.health.local_ray import RAY_LOST_S
from pdserve.cluster.health.worker_host import STOP_S

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def checkout(dest: Path) -> Path:
    """The repository's files as a fresh clone has them (what git tracks, and new files it does not
    ignore): `ray up` hashes and copies every file under its file mounts."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.split(b"\0")
    dest.mkdir()
    for f in filter(None, files):
        src, dst = ROOT / os.fsdecode(f), dest / os.fsdecode(f)
        if src.is_file():
            dst.parent.mkdir(parents=True, exist_ok=True)
            dst.write_bytes(src.read_bytes())
    return dest


def leftovers(bed: HostBed, host: str) -> list[str]:
    """The processes running on `host` but its own (the host's init, its sshd's listener)."""
    out = bed.run(host, "ps", "-eo", "pid=,args=").stdout.splitlines()
    mine = ("sshd: ", "sleep 3600", "ps -eo")
    return [line.strip() for line in out if int(line.split()[0]) != 1 and not line.split(None, 1)[1].startswith(mine)]


def test_ray_up_of_the_onprem_config_serves_at_the_heads_address_and_ray_down_leaves_nothing(tmp_path):
    key = tmp_path / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    tools = subprocess.run(["bash", str(ROOT / "scripts" / "install_sshd.sh")], capture_output=True, text=True,
                           check=True).stdout.strip()
    with HostBed(3, ssh_key=f"{key}.pub") as bed:
        config = yaml.safe_load((ROOT / "configs" / "onprem.yaml").read_text())
        # as written apart from its host list, its SSH login and a name of this bed's (Ray's local
        # provider keeps its state in /tmp/cluster-NAME.state on the machine that runs ray up)
        config["cluster_name"] = f"pdserve-{bed.name}"
        config["provider"] |= {"head_ip": bed.addr["h1"], "worker_ips": [bed.addr["h2"], bed.addr["h3"]]}
        config["auth"] = {"ssh_user": "root", "ssh_private_key": str(key)}
        cfg = tmp_path / "cluster.yaml"
        cfg.write_text(yaml.safe_dump(config, sort_keys=False))
        home = tmp_path / "home"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "PDSERVE_"))}
        env |= {"HOME": str(home), "PATH": f"{tools}{os.pathsep}{Path(sys.executable).parent}{os.pathsep}{env['PATH']}",
                "RAY_UP_enable_autoscaler_v2": "0"}  # as the config's first lines say
        ray = [sys.executable, "-m", "ray.scripts.scripts"]
        subprocess.run([*ray, "get-auth-token", "--generate"], env=env, capture_output=True, check=True)
        src = checkout(tmp_path / "pdserve")
        ssh = ["ssh", "-i", str(key), "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
               "-o", "LogLevel=ERROR", "-o", "BatchMode=yes", f"root@{bed.addr['h1']}"]
        try:
            up = subprocess.run([*ray, "up", "-y", str(cfg)], cwd=src, env=env, capture_output=True, text=True,
                                timeout=600)
            assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
            keys = dict(line.split("=", 1) for line in subprocess.run(
                [*ssh, "cat ~/.pdserve/keys.env"], capture_output=True, text=True, check=True).stdout.split())
            url = keys["PDSERVE_URL"]
            assert url == f"http://{bed.addr['h1']}:8000"

            def complete():
                try:
                    r = httpx.post(f"{url}/v1/completions", timeout=60, headers={
                        "Authorization": f"Bearer {keys['PDSERVE_API_KEY']}"},
                        json={"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})
                except httpx.TransportError:
                    return None
                return r if r.status_code != 503 else None

            r = wait_for(complete, 300, "the router at the head's address", every_s=2)
            assert r.status_code == 200, r.text
            assert "Paris" in r.json()["choices"][0]["text"]
            unkeyed = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=10)
            assert unkeyed.status_code == 401
            status = subprocess.run([*ssh, "RAY_AUTH_MODE=token ray status"], capture_output=True, text=True)
            assert " 3 local.cluster.node" in status.stdout, status.stdout[-2000:]  # the head and both workers
        finally:
            down = subprocess.run([*ray, "down", "-y", str(cfg)], cwd=src, env=env, capture_output=True, text=True,
                                  timeout=300)
        assert down.returncode == 0, down.stdout[-3000:] + down.stderr[-3000:]
        # the head's Ray stops at once, and its router once the GCS has refused it for RAY_LOST_S (it
        # lived on for Ray's 60 s, a core spinning in Ray's error listener); a worker host's Ray as soon
        # as its `pdserve join` has seen the same (Ray alone: the raylet's minute, its agents after it)
        t0 = time.monotonic()
        for host in bed.hosts:
            wait_for(lambda h=host: not leftovers(bed, h), RAY_LOST_S + STOP_S + 15,
                     f"{host}: {leftovers(bed, host)} still running", every_s=1)
        print(f"every host empty {time.monotonic() - t0:.0f} s after ray down")
