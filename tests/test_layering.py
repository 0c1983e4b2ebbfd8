"""The layers import downwards only: cluster/ -> actors/ -> kvcore/, and inside each the folders by role in
one direction (FOLDER_RULES), with no import circle between files or folders and no `_private` name
imported from another file. The folders of the driver and the client process import no tensor library
(TORCH_FREE). Every module is parsed (imports inside functions count too), so a lazy import cannot hide
from the checks."""

import ast
import graphlib
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
# What each package must never import (top-level module names).
FORBIDDEN = {
    "kvcore": {"actors", "cluster", "ray"},
    "actors": {"cluster"},
}
# The scheduler decides which tokens run; it never touches a tensor.
TENSOR_FREE = (*sorted(str(p.relative_to(ROOT)) for p in (ROOT / "kvcore/sched").glob("*.py")), "kvcore/request.py")
TENSOR_LIBS = {"torch", "triton", "numpy"}
PACKAGES = ("kvcore", "actors", "cluster")

# Folders (their files, not their subfolders) and files that import neither torch nor triton, not even
# lazily: the driver process (scheduler, KV-cache books, executor, transport) and the client process
# (the LLM API, the job, the stress run, serve) load no tensor library; torch lives in the workers.
TORCH_FREE = {
    "kvcore/sched",
    "kvcore/kv_cache",
    "kvcore/request.py",
    "kvcore/messages.py",
    "actors/errors.py",
    "actors/messages.py",
    "actors/gc_heap.py",
    "actors/driver",
    "actors/transport",
    "actors/executor/base.py",
    "actors/executor/ray_workers.py",
    "actors/executor/node_probe.py",
    "actors/models/model_dir.py",
    "cluster/client",
    "cluster/job",
    "cluster/replicas",
    "cluster/serve",
    "cluster/stress",
}
TORCH_LIBS = {"torch", "triton"}

# Which folders a folder's files never import (a folder here means its own files, not its subfolders).
# The order they state: in actors/, driver -> executor -> worker -> {sample, models -> layers ->
# layers/kernels} and transport, all on config and the top-level files (errors, messages, the batch);
# in kvcore/, the contracts at the top, sched, kv_cache and kernels beside each other; in cluster/,
# the entry points at the top over serve, stress, job -> client -> replicas.
ACTOR_FOLDERS = {
    f"actors/{name}"
    for name in ("config", "driver", "executor", "transport", "worker", "sample", "profiling", "layers", "models")
} | {"actors/layers/kernels"}
FOLDER_RULES = {
    "actors/config": ACTOR_FOLDERS - {"actors/config"},
    "actors/driver": {
        "actors/worker",
        "actors/models",
        "actors/layers",
        "actors/layers/kernels",
        "actors/sample",
        "actors/profiling",
        "actors/transport",
    },
    "actors/executor": {"actors/driver"},
    "actors/transport": ACTOR_FOLDERS - {"actors/transport"},
    "actors/worker": {"actors/driver", "actors/executor"},
    "actors/sample": ACTOR_FOLDERS - {"actors/sample"},
    "actors/models": {"actors/driver", "actors/executor", "actors/worker", "actors/sample", "actors/transport"},
    "actors/layers": {
        "actors/driver",
        "actors/executor",
        "actors/worker",
        "actors/sample",
        "actors/transport",
        "actors/models",
    },
    "actors/layers/kernels": ACTOR_FOLDERS - {"actors/layers/kernels"},
    "actors/profiling": ACTOR_FOLDERS - {"actors/profiling"},
    "actors": ACTOR_FOLDERS,  # the top-level files are the bottom of actors/
    "kvcore/kernels": {"kvcore/sched", "kvcore/kv_cache"},
    "kvcore/sched": {"kvcore/kernels", "kvcore/kv_cache"},
    "kvcore/kv_cache": {"kvcore/kernels", "kvcore/sched"},
    "cluster/client": {"cluster/job", "cluster/stress", "cluster/serve"},
    "cluster/replicas": {"cluster/client", "cluster/job", "cluster/stress", "cluster/serve"},
    "cluster/job": {"cluster/stress", "cluster/serve"},
    "cluster/serve": {"cluster/stress"},
    "cluster/stress": {"cluster/serve"},
}


def imported_modules(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, dotted module) for every import statement in the file, relative ones resolved."""
    package = path.relative_to(ROOT).with_suffix("").parts[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1])
                found.append((node.lineno, f"{base}.{node.module}" if node.module else base))
            else:
                found.append((node.lineno, node.module or ""))
    return found


def modules_of(package: str) -> list[pathlib.Path]:
    return sorted((ROOT / package).rglob("*.py"))


def module_files(roots: tuple[str, ...] = PACKAGES) -> dict[str, pathlib.Path]:
    """dotted module name -> its file, for every module under `roots` (a package by its __init__.py)."""
    found = {}
    for root in roots:
        for path in modules_of(root):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported_names(path: pathlib.Path) -> list[tuple[int, str, str | None]]:
    """(line, dotted module, name or None) for every import statement; `from m import a, b` gives two."""
    package = path.relative_to(ROOT).with_suffix("").parts[:-1]
    found: list[tuple[int, str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1])
                module = f"{base}.{module}" if module else base
            found += [(node.lineno, module, alias.name) for alias in node.names]
    return found


def target_module(modules: dict[str, pathlib.Path], module: str, name: str | None) -> str | None:
    """The project module an import reaches: `from pkg import sub` reaches pkg.sub when it is one."""
    if name is not None and f"{module}.{name}" in modules:
        return f"{module}.{name}"
    while module and module not in modules:
        module = module.rpartition(".")[0]
    return module or None


def file_graph(roots: tuple[str, ...] = PACKAGES) -> dict[pathlib.Path, set[pathlib.Path]]:
    """Which project files each file imports (lazy imports included; a package's __init__ is a file too)."""
    modules = module_files(roots)
    graph: dict[pathlib.Path, set[pathlib.Path]] = {}
    for path in modules.values():
        deps = {modules[t] for _, m, n in imported_names(path) if (t := target_module(modules, m, n)) is not None}
        graph[path] = deps - {path}
    return graph


def node_of(path: pathlib.Path) -> str:
    """A file's folder (relative), or the file itself when it sits at the top of kvcore/, actors/, cluster/."""
    rel = path.relative_to(ROOT)
    return str(rel) if len(rel.parts) == 2 else str(rel.parent)


def folder_of(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT).parent)


def cycle_in(graph: dict[str, set[str]]) -> list[str] | None:
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        return list(e.args[1])
    return None


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_upward_imports(package):
    files = modules_of(package)
    assert files, f"no modules found under {package}/"
    bad = [
        f"{p.relative_to(ROOT)}:{line} imports {mod}"
        for p in files
        for line, mod in imported_modules(p)
        if mod.split(".")[0] in FORBIDDEN[package]
    ]
    assert not bad, "upward import(s):\n" + "\n".join(bad)


def test_the_scheduler_never_imports_a_tensor_library():
    bad = [
        f"{name}:{line} imports {mod}"
        for name in TENSOR_FREE
        for line, mod in imported_modules(ROOT / name)
        if mod.split(".")[0] in TENSOR_LIBS
    ]
    assert not bad, "\n".join(bad)


def test_the_check_sees_lazy_and_relative_imports(tmp_path, monkeypatch):
    pkg = tmp_path / "kvcore"
    pkg.mkdir()
    (pkg / "m.py").write_text("def f():\n    import ray.util\n    from . import spec\n    from .x import y\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert [m for _, m in imported_modules(pkg / "m.py")] == ["ray.util", "kvcore", "kvcore.x"]


def loaded_tensor_libs(modules: str, then: str = "") -> str:
    """Which of torch and triton importing `modules` (comma-separated) and running `then` pulls in, in
    a fresh process."""
    code = f"import sys, {modules}; {then or 'pass'}; print(sorted(m for m in ('torch', 'triton') if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_the_client_side_never_loads_torch():
    # The LLM API, the job and the CLI only talk to driver actors; torch (seconds to import) stays there.
    assert (
        loaded_tensor_libs(
            "cluster.cli, cluster.llm, cluster.job.runner, cluster.replicas.engine_group, cluster.client.stream, "
            "cluster.stress.run, "
            "cluster.stress.reference, cluster.info"
        )
        == "[]"
    )


def test_the_driver_process_never_loads_torch():
    # The driver actor (scheduler, KV-cache manager, transport) holds no tensor: importing torch there
    # cost seconds of every engine start and rebuild.
    assert (
        loaded_tensor_libs(
            "actors.driver.actor, actors.driver.engine_core, actors.executor.ray_workers, "
            "actors.transport.shm, actors.executor.node_probe"
        )
        == "[]"
    )


def test_the_client_checks_a_model_without_torch(tmp_path):
    # What LLM(...) and `kvray run` do on the client before Ray starts: find the model, read config.json,
    # the tokenizer and generation_config.json, and check the architecture. Lazy imports there once
    # pulled torch into every client (~3 s of each start-up on the H200 host).
    (tmp_path / "config.json").write_text(
        '{"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 64, "hidden_size": 16, '
        '"num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, '
        '"intermediate_size": 32, "max_position_embeddings": 128}'
    )
    then = (
        "from cluster.config import EngineConfig; from cluster.cli import check_model; "
        f"c = EngineConfig().replace(model={str(tmp_path)!r}); "
        "tok, hf = cluster.llm.load_client_model(c); cluster.llm.check_client_model(c, hf); "
        "cluster.llm.client_model_dir(c); cluster.llm.default_sampling_params(cluster.llm.client_model_dir(c)); "
        "check_model(c); assert hf['model_type'] == 'qwen3'"
    )
    assert loaded_tensor_libs("cluster.llm, cluster.cli", then) == "[]"


def test_every_folder_imports_only_the_folders_its_rule_allows():
    bad = sorted(
        f"{src.relative_to(ROOT)} imports {dst.relative_to(ROOT)} ({folder_of(src)} never imports {folder_of(dst)})"
        for src, deps in file_graph().items()
        for dst in deps
        if folder_of(dst) in FOLDER_RULES.get(folder_of(src), set())
    )
    assert not bad, "\n".join(bad)


def test_the_folder_rules_name_real_folders():
    folders = {folder_of(p) for p in module_files().values()}
    named = set(FOLDER_RULES) | {f for rule in FOLDER_RULES.values() for f in rule}
    assert named <= folders, sorted(named - folders)
    assert {t.rstrip("/") for t in TORCH_FREE} <= folders | {str(p.relative_to(ROOT)) for p in module_files().values()}


def test_no_file_imports_itself_through_a_circle():
    graph = {str(p.relative_to(ROOT)): {str(d.relative_to(ROOT)) for d in deps} for p, deps in file_graph().items()}
    # Lazy imports count: a circle that only closes inside a function still ties the two files together.
    cycle = cycle_in(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_no_folder_imports_itself_through_a_circle():
    graph: dict[str, set[str]] = {}
    for src, deps in file_graph().items():
        graph.setdefault(node_of(src), set()).update(node_of(d) for d in deps if node_of(d) != node_of(src))
    cycle = cycle_in(graph)
    assert cycle is None, "folder circle: " + " -> ".join(cycle)


def test_the_graph_sees_circles_through_lazy_imports_and_packages(tmp_path, monkeypatch):
    pkg = tmp_path / "kvcore"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from kvcore.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..a import x\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    graph = {
        str(p.relative_to(tmp_path)): {str(d.relative_to(tmp_path)) for d in ds}
        for p, ds in file_graph(("kvcore",)).items()
    }
    assert graph["kvcore/a.py"] == {"kvcore/sub/b.py"} and graph["kvcore/sub/b.py"] == {"kvcore/a.py"}
    assert cycle_in(graph) is not None


def test_no_private_name_is_imported_from_another_file():
    # Tests too: they use the public seams of the product and of their helpers.
    modules = module_files((*PACKAGES, "tests"))
    modules.update({p.stem: p for p in (ROOT / "tests").glob("*.py")})  # tests import their helpers by name
    bad = sorted(
        {
            f"{path.relative_to(ROOT)}:{line} imports {name} from {module}"
            for path in set(modules.values())
            for line, module, name in imported_names(path)
            if name is not None
            and name.startswith("_")
            and not name.startswith("__")
            and target_module(modules, module, None) is not None
        }
    )
    assert not bad, "\n".join(bad)


def test_the_driver_and_client_folders_import_no_torch():
    files = module_files().values()
    bad = sorted(
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in files
        if folder_of(path) in TORCH_FREE or str(path.relative_to(ROOT)) in TORCH_FREE
        for line, module, _ in imported_names(path)
        if module.split(".")[0] in TORCH_LIBS
    )
    assert not bad, "\n".join(bad)
