"""The layers import downwards only: cluster/ -> actors/ -> kvcore/. Every module is parsed (imports inside
functions count too), so a lazy upward import cannot hide from the check."""

import ast
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
            "cluster.cli, cluster.llm, cluster.job.batch_job, cluster.replicas.engine_group, cluster.client.stream, "
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
            "actors.driver.engine_driver, actors.driver.engine_core, actors.executor.ray_workers, actors.transport.shm"
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
