"""One import namespace: a built wheel holds pdserve/* and no top-level engine/ etc."""

import pathlib
import subprocess
import sys
import zipfile

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_wheel_maps_folders_into_pdserve(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(ROOT)], check=True, timeout=300)
    (wheel,) = tmp_path.glob("pdserve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for mod in ("pdserve/__init__.py", "pdserve/engine/engine.py", "pdserve/engine/ops/triton_attention.py",
                "pdserve/engine/models/llama.py", "pdserve/cli.py", "pdserve/router/app.py",
                "pdserve/bench/data/mooncake_conversation_trace.jsonl", "pdserve/bench/data/NOTICE.md"):
        assert mod in names, mod
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"pdserve"}
    # every module of every folder (a subpackage missing from pyproject's list was left out)
    folders = {"engine": "pdserve/engine", "transfer": "pdserve/transfer", "prefill": "pdserve/prefill",
               "decode": "pdserve/decode", "cluster": "pdserve/cluster", "router": "pdserve/router",
               "src/pdserve": "pdserve"}
    missing = [f"{folder}/{path.relative_to(ROOT / folder)}" for folder, into in folders.items()
               for path in (ROOT / folder).rglob("*.py") if "__pycache__" not in path.parts
               and f"{into}/{path.relative_to(ROOT / folder).as_posix()}" not in names]
    assert not missing, f"modules the wheel lacks (pyproject.toml's packages): {missing}"
