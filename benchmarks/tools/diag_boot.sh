#!/usr/bin/env bash
# Where a fresh Python process's start-up goes on this host: the worker's boot (Python + Ray up to
# kvray's import) was 2.9-4.2 s on the H200 against 0.3 s on the CPU machine, and torch's import
# 3.5-4.5 s. Prints the interpreter's bytecode settings, how many of Ray's and torch's modules have
# compiled bytecode, and the wall time of each import in a fresh process, twice (the second sees
# whatever bytecode the first wrote). Run from the repo root after `source .gpu/bootstrap.sh`.
set -u
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
env | grep -E '^PYTHON|^RAY_' | sort
python3 - <<'EOF'
import os, sys, importlib.util
print("dont_write_bytecode", sys.dont_write_bytecode, "pycache_prefix", sys.pycache_prefix, "cores", len(os.sched_getaffinity(0)))
for name in ("ray", "torch", "triton"):
    root = os.path.dirname(importlib.util.find_spec(name).origin)
    py = pyc = 0
    for d, _, files in os.walk(root):
        py += sum(f.endswith(".py") for f in files)
        pyc += sum(f.endswith(".pyc") for f in files)
    print(f"{name}: {root} writable={os.access(root, os.W_OK)} .py={py} .pyc={pyc}")
EOF
imp() {  # label, python statement: wall time of a fresh interpreter running it
  local TIMEFORMAT="import $1: %R s"
  time python3 -c "$2" >/dev/null 2>&1
}
for round in 1 2; do
  echo "-- round $round"
  imp python "pass"
  imp ray "import ray"
  imp default_worker "import ray._private.workers.default_worker"
  imp torch "import torch"
  imp triton "import triton"
  imp actors.worker.actor "import actors.worker.actor"
done
python3 -X importtime -c "import ray" 2>&1 | sort -t'|' -k2 -n | tail -8
python3 -X importtime -c "import actors.worker.actor" 2>&1 | sort -t'|' -k2 -n | tail -12
