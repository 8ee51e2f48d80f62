"""Imports go one way (DESIGN.md): engine <- transfer <- prefill/decode <- cluster <- router."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
ORDER = ["engine", "transfer", "prefill", "decode", "cluster", "router"]
ALLOWED = {
    "engine": set(),
    "transfer": {"engine"},
    "prefill": {"engine", "transfer"},
    "decode": {"engine", "transfer"},
    "cluster": {"engine", "transfer", "prefill", "decode"},
    "router": {"engine", "transfer", "prefill", "decode", "cluster"},
}
FORBIDDEN_THIRD_PARTY = {"engine": {"ray", "fastapi", "uvicorn", "starlette"},
                         "transfer": {"fastapi", "uvicorn", "starlette"}}


def imports(path: pathlib.Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


@pytest.mark.parametrize("pkg", ORDER)
def test_imports_go_one_way(pkg):
    for f in (ROOT / pkg).rglob("*.py"):
        for mod in imports(f):
            parts = mod.split(".")
            if parts[0] == "pdserve" and len(parts) > 1 and parts[1] in ALLOWED:
                assert parts[1] == pkg or parts[1] in ALLOWED[pkg], f"{f}: imports {mod}"
            assert parts[0] not in FORBIDDEN_THIRD_PARTY.get(pkg, set()), f"{f}: imports {mod}"
