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
    "cluster": {  # cluster-relative dotted names (cluster/ is cut by concept: CLUSTER_CONCEPTS)
        "aio": set(), "api": set(), "records": set(),
        "spec.serving_config": set(), "spec.engine_specs": {"spec.serving_config"},
        "spec.cluster_spec": {"spec.engine_specs", "spec.serving_config"},
        "registry.registry": {"aio", "records"}, "registry.registry_link": {"aio", "records", "registry.registry"},
        "workers.gpus": set(), "workers.worker_commands": set(), "workers.peer_calls": set(),
        "workers.output_pipe": {"aio"}, "workers.outlets": {"workers.output_pipe", "workers.worker_commands"},
        "workers.engine_loop": {"records", "workers.worker_commands"},
        "workers.shard_actor": {"spec.serving_config", "workers.gpus"},
        "workers.worker_actor": {"records", "registry.registry", "spec.serving_config", "workers.engine_loop",
                                 "workers.gpus", "workers.outlets", "workers.output_pipe", "workers.peer_calls",
                                 "workers.shard_actor", "workers.worker_commands"},
        "placement.routing": {"api"}, "placement.handoff_cost": {"records"},
        "placement.pool_view": {"placement.routing", "records"},
        "placement.placement": {"api", "placement.handoff_cost", "placement.pool_view", "placement.routing",
                                "records", "registry.registry", "spec.cluster_spec"},
        "pools.autoscale": {"spec.serving_config"}, "pools.ratio": {"api", "records", "spec.serving_config"},
        "pools.pool_monitor": {"aio", "pools.autoscale", "records", "spec.serving_config"},
        "pools.pools": {"aio", "placement.pool_view", "pools.autoscale", "pools.pool_monitor", "pools.ratio", "records",
                        "spec.cluster_spec", "spec.serving_config", "workers.output_pipe", "workers.shard_actor",
                        "workers.worker_actor"},
        "dispatch.attempt": {"placement.placement"},
        "dispatch.dispatch": {"aio", "api", "dispatch.attempt", "placement.placement", "pools.pools", "records",
                              "spec.cluster_spec", "workers.output_pipe"},
        "health.reaper": set(), "health.local_ray": {"health.reaper"},
        "health.worker_host": {"health.local_ray", "health.reaper"},
        "health.links": {"aio", "placement.placement", "records"},
        "cluster": {"aio", "api", "dispatch.dispatch", "health.links", "health.local_ray", "pools.pools", "records",
                    "registry.registry", "registry.registry_link", "spec.cluster_spec", "spec.serving_config",
                    "workers.gpus", "workers.output_pipe"},
        "__init__": {"cluster", "spec.cluster_spec"},
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
    "transfer": {"records": set(), "base": {"records"}, "shared": set(), "wire": {"base"},
                 "pull": {"base", "records", "shared", "wire"}, "pair": {"base", "pull", "records", "wire"},
                 "c10d": {"base", "pair", "probe", "records", "wire"}, "probe": set(), "loopback": {"base", "records"},
                 "tp": {"base"}, "fetch": {"base"}, "__init__": {"base", "records"}},
}


def module_name(path: pathlib.Path, pkg: str) -> str:
    """A module's package-relative dotted name: "pools.ratio", "cluster", "__init__"."""
    parts = path.relative_to(ROOT / pkg).with_suffix("").parts
    return ".".join(parts)


def local_imports(path: pathlib.Path, pkg: str):
    """The package-relative dotted names of the package's modules `path` imports."""
    here = list(path.relative_to(ROOT / pkg).parts[:-1])
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level >= 1:
                yield ".".join(here[:len(here) - (node.level - 1)] + ([node.module] if node.module else []))
            elif node.level == 0 and node.module and node.module.startswith(f"pdserve.{pkg}."):
                yield node.module[len(f"pdserve.{pkg}."):]


@pytest.mark.parametrize("pkg", sorted(INTRA))
def test_modules_inside_a_package_import_one_way(pkg):
    allowed = INTRA[pkg]
    for f in (ROOT / pkg).rglob("*.py"):
        name = module_name(f, pkg)
        if name.endswith(".__init__"):  # a concept's __init__ says what it holds and imports nothing
            assert not list(local_imports(f, pkg)), f"{f}: a subpackage's __init__ imports nothing"
            continue
        assert name in allowed, f"{f}: a new module: give it its place in INTRA"
        for mod in local_imports(f, pkg):
            assert mod in allowed[name], f"{f}: imports {mod}"


# cluster/ is cut by concept, bottom up: a module imports modules of its own concept or of those below
# it (docs/architecture.md, section 3): the vocabulary (records, api, aio), what the cluster is (spec/),
# the block registry, one worker, where a request goes, the pools and their scaling, one request's
# dispatch, faults and health, and last the facade.
CLUSTER_CONCEPTS = [("aio", "api", "records"), ("spec",), ("registry",), ("workers",), ("placement",), ("pools",),
                    ("dispatch",), ("health",), ("cluster", "__init__")]


def rank_in(layers: list[tuple[str, ...]], module: str, pkg: str) -> int:
    """The index of the layer (or concept) of `pkg`'s module `module` (dotted, package-relative)."""
    head = module.split(".")[0]
    for i, layer in enumerate(layers):
        if head in layer:
            return i
    raise AssertionError(f"{pkg}/{module}: a new subpackage or top-level module: give it its place in the layers")


def concept_of(module: str) -> int:
    return rank_in(CLUSTER_CONCEPTS, module, "cluster")


def test_the_cluster_is_cut_by_concept_and_its_concepts_import_one_way():
    for f in (ROOT / "cluster").rglob("*.py"):
        name = module_name(f, "cluster")
        for mod in local_imports(f, "cluster"):
            assert concept_of(mod) <= concept_of(name), f"cluster/{name} imports {mod}, a concept above it"
    tops = {f.stem for f in (ROOT / "cluster").glob("*.py")}
    assert tops == {"__init__", "aio", "api", "records", "cluster"}, f"cluster/: modules outside a concept: {tops}"


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
    return rank_in(ENGINE_LAYERS, module, "engine")


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
