"""Compile the bytecode of every package the engine's processes import, as `pip install` does at install.

The H200 image ships torch, triton and the rest without a single .pyc and sets PYTHONDONTWRITEBYTECODE=1,
and the slim Ray sent along (.gpu/) has none either: there every new Python process compiled torch
(import torch 3.8-5.1 s, against 2.0 s on the CPU machine with bytecode) and Ray from source. A user's
pip-installed environment has the bytecode. This compiles, in place, the top-level packages that the
client, the driver, the workers and Ray's own processes (dashboard, agents, monitor) import.

  python -m benchmarks.tools.compile_bytecode
"""

from __future__ import annotations

import compileall
import importlib
import os
import sys
import sysconfig
import time

MODULES = [
    "ray",
    "torch",
    "triton",
    "numpy",
    "yaml",
    "zmq",
    "safetensors",
    "tokenizers",
    "actors.worker.actor",
    "actors.driver.actor",
    "cluster.llm",
    "ray._private.workers.default_worker",
    "ray.dashboard.agent",
    "ray.dashboard.dashboard",
    "ray._private.runtime_env.agent.main",
    "ray.autoscaler._private.monitor",
    "ray._private.log_monitor",
]


def package_roots() -> set[str]:
    """The directories (or single files) of the top-level packages now imported from site-packages."""
    sites = {os.path.realpath(p) for p in (sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"])}
    sites |= {os.path.realpath(p) for p in sys.path if p.endswith("site-packages") or p == "/tmp/site"}
    roots = set()
    for mod in list(sys.modules.values()):
        f = getattr(mod, "__file__", None)
        if not f:
            continue
        f = os.path.realpath(f)
        for site in sites:
            if f.startswith(site + os.sep):
                top = f[len(site) + 1 :].split(os.sep)[0]
                roots.add(os.path.join(site, top))
    return roots


def main() -> None:
    for name in MODULES:
        try:
            importlib.import_module(name)
        except ImportError as e:  # a Ray entry point that needs what the slim Ray left out
            print(f"skip {name}: {type(e).__name__}: {e}")
    roots = sorted(package_roots())
    t0 = time.perf_counter()
    ok = True
    for root in roots:
        if os.path.isdir(root):
            ok &= bool(compileall.compile_dir(root, quiet=2, workers=0))
        elif root.endswith(".py"):
            ok &= bool(compileall.compile_file(root, quiet=2))
    took = time.perf_counter() - t0
    # False is usual: a package may hold files written for other Python versions.
    print(f"compiled the bytecode of {len(roots)} packages in {took:.1f} s (every file compiled: {ok})")


if __name__ == "__main__":
    main()
