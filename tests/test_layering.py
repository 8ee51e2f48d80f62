"""Imports go one way (docs/architecture.md): engine <- transfer <- prefill/decode <- cluster <- router."""

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


# Inside a package, modules also import one way (a module imports only those listed for it).
INTRA = {
    "cluster": {
        "aio": set(), "gpus": set(), "serving_config": set(), "routing": {"api"}, "registry": {"aio", "records"},
        "registry_link": {"aio", "records", "registry"}, "api": set(), "records": set(),
        "local_ray": {"reaper"}, "reaper": set(), "output_pipe": {"aio"}, "outlets": {"output_pipe", "worker_commands"},
        "autoscale": {"serving_config"}, "ratio": {"api", "records", "serving_config"},
        "shard_actor": {"gpus", "serving_config"}, "worker_commands": set(),
        "peer_calls": set(),
        "engine_loop": {"records", "worker_commands"},
        "worker_actor": {"engine_loop", "gpus", "outlets", "output_pipe", "peer_calls", "records", "registry",
                         "serving_config", "shard_actor", "worker_commands"},
        "pool_monitor": {"aio", "autoscale", "records", "serving_config"},
        "engine_specs": {"serving_config"},
        "cluster_spec": {"engine_specs", "serving_config"},
        "pool_view": {"records", "routing"},
        "pools": {"aio", "autoscale", "cluster_spec", "output_pipe", "pool_monitor", "pool_view", "ratio", "records",
                  "serving_config", "shard_actor", "worker_actor"},
        "handoff_cost": {"records"},
        "placement": {"api", "cluster_spec", "handoff_cost", "pool_view", "records", "registry", "routing"},
        "attempt": {"placement"},
        "links": {"aio", "placement", "records"},
        "dispatch": {"aio", "api", "attempt", "cluster_spec", "output_pipe", "placement", "pools", "records"},
        "cluster": {"aio", "api", "cluster_spec", "dispatch", "gpus", "links", "local_ray", "output_pipe", "pools",
                    "records", "registry", "registry_link", "serving_config"},
        "__init__": {"cluster", "cluster_spec"},
    },
    "router": {
        "tool_parsers": set(), "tools": {"tool_parsers"}, "schemas": {"tools", "tool_parsers"}, "errors": {"schemas"},
        "render": {"tools"}, "runner": {"errors", "options", "schemas"}, "metrics": set(), "openapi": {"schemas"},
        "chat": {"errors"},
        "tokens": {"chat", "errors", "runner", "schemas"},
        "options": set(),
        "app": {"chat", "errors", "metrics", "openapi", "options", "render", "runner", "schemas", "tokens",
                "tool_parsers", "tools"},
        "server": {"schemas"},
        "__init__": {"app"},
    },
    "transfer": {"base": set(), "shared": set(), "wire": {"base"}, "pull": {"base", "shared", "wire"},
                 "pair": {"base", "pull", "wire"}, "c10d": {"base", "pair", "probe", "wire"},
                 "probe": set(), "loopback": {"base"},
                 "tp": {"base"}, "fetch": {"base"}, "__init__": {"base"}},
}


def local_imports(path: pathlib.Path, pkg: str):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:
                yield node.module or ""
            elif node.level == 0 and node.module and node.module.startswith(f"pdserve.{pkg}."):
                yield node.module.split(".")[2]


@pytest.mark.parametrize("pkg", sorted(INTRA))
def test_modules_inside_a_package_import_one_way(pkg):
    allowed = INTRA[pkg]
    for f in (ROOT / pkg).glob("*.py"):
        assert f.stem in allowed, f"{f}: a new module: give it its place in INTRA"
        for mod in local_imports(f, pkg):
            assert mod in allowed[f.stem], f"{f}: imports .{mod}"


def test_the_router_uses_the_cluster_through_its_declared_interface():
    """router/ reads a cluster only through cluster/api.py (ServingCluster, RequestObserver)."""
    for f in (ROOT / "router").glob("*.py"):
        for mod in imports(f):
            if mod.startswith("pdserve.cluster"):
                assert mod == "pdserve.cluster.api", f"{f}: imports {mod}"


@pytest.mark.parametrize("pkg", ORDER)
def test_files_and_functions_stay_small(pkg):
    """One concept per file: no module over 400 lines, no function over 80."""
    for f in (ROOT / pkg).rglob("*.py"):
        text = f.read_text()
        assert text.count("\n") <= 400, f"{f}: {text.count(chr(10))} lines"
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                assert n <= 80, f"{f}:{node.lineno} {node.name} is {n} lines"


def runtime_imports(path: pathlib.Path) -> set[str]:
    """The engine modules a module imports when it runs, at its top or inside a function (an
    import under `if TYPE_CHECKING` is for annotations only), as engine-relative dotted names:
    `from ..ops import kv_quant` in exec/kv_cache.py yields "ops.kv_quant"."""
    tree, pkg = ast.parse(path.read_text()), list(path.relative_to(ROOT / "engine").with_suffix("").parts[:-1])
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and getattr(node.test, "id", None) == "TYPE_CHECKING" for n in ast.walk(node)}
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level >= 1 and id(node) not in typing_only:
            base = pkg[:len(pkg) - (node.level - 1)] if node.level > 1 else pkg
            module = [*base, *node.module.split(".")] if node.module else base
            for a in node.names:  # a name that is a module is that module; else one of `module`'s
                out.add(".".join([*module, a.name]) if _is_module([*module, a.name]) else ".".join(module))
    return {f"{m}.__init__" if (ROOT / "engine" / m.replace(".", "/")).is_dir() else m or "__init__" for m in out}


def _is_module(parts: list[str]) -> bool:
    path = ROOT / "engine" / "/".join(parts)
    return path.is_dir() or path.with_suffix(".py").exists()


def engine_graph() -> dict[str, set[str]]:
    """Each engine module (dotted, engine-relative) and the engine modules it imports at run time."""
    graph = {".".join(f.relative_to(ROOT / "engine").with_suffix("").parts): runtime_imports(f)
             for f in (ROOT / "engine").rglob("*.py")}
    return {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}


# The engine's layers, bottom up: a module imports, when it runs, modules of its own layer or of
# the layers below it (an import under TYPE_CHECKING is free); a subpackage is one layer, and the
# top-level modules sit in the two layers named by them. docs/architecture.md, section 3, says why.
ENGINE_LAYERS = [
    ("ops",),  # kernels and the formats they read
    ("base",),  # the floor: TP groups and stores, device copies, block hashes, KV layout and window
    ("architectures", "sampling_params", "validation", "outputs", "tokenizer", "default_model", "role",
     "fp8", "settings", "config", "stats"),  # what a caller hands the engine, settings, a checkpoint's format, counters
    ("core",),  # requests, the block pool, the scheduler, the step model
    ("tiers",),  # the KV tiers below the GPU
    ("sample",),  # from logits to tokens
    ("models",),  # the families, their shared layers and attention
    ("exec",),  # running a step: runner, graphs, the KV tensor, loading, shards
    ("spec",),  # speculative decoding drives a runner of its own
    ("assembly", "engine", "llm", "__init__"),  # the assembly
]


def layer_of(module: str) -> int:
    """The layer of an engine module (dotted, engine-relative)."""
    head = module.split(".")[0]
    for i, layer in enumerate(ENGINE_LAYERS):
        if head in layer:
            return i
    raise AssertionError(f"engine/{module}: a new subpackage or top-level module: give it its layer in ENGINE_LAYERS")


def test_the_engine_imports_in_its_declared_layers():
    for module, deps in engine_graph().items():
        for dep in deps:
            assert layer_of(dep) <= layer_of(module), \
                f"engine/{module} imports {dep}, a layer above it in ENGINE_LAYERS"


def test_the_engine_has_no_import_circle_at_run_time():
    """No engine module reaches itself through the imports it runs, lazy ones included (the
    configuration reached speculative decoding's machinery, and through the draft model the
    runner and the sampler, which imported speculative decoding again)."""
    graph = engine_graph()

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for m in graph.get(todo.pop(), ()):
                if m in graph and m not in seen:
                    seen.add(m)
                    todo.append(m)
        return seen

    circles = sorted(m for m in graph if m in reach(m))
    assert not circles, f"engine modules in an import circle: {circles}"
