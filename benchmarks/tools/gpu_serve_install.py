"""Installs into /tmp/site (KVRAY_GPU_SITE) what Ray Serve needs on the GPU host and its image lacks:
ray/serve (cut from the slim Ray) and each wheel of .gpu/serve/ whose import name the image cannot import.
Copied to .gpu/serve/install.py by benchmarks/tools/gpu_bundle_extras.sh and run there as
`python3 .gpu/serve/install.py`,
or from the repo root as `python -m benchmarks.tools.gpu_serve_install` (the serve suite's first step), which reads
the bundle in .gpu/serve/.
"""

import importlib.util
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

# The bundle: this file's folder when it is the bundle's copy, else .gpu/serve under the working directory.
HERE = Path(__file__).resolve().parent if Path(__file__).resolve().parent.name == "serve" else Path(".gpu/serve")
SITE = os.environ.get("KVRAY_GPU_SITE", "/tmp/site")
DRY = "--dry-run" in sys.argv


def importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # its parent package is missing
        return False


def import_names(whl: Path) -> set[str]:
    """What a wheel installs, as import names; for a namespace package (google, opentelemetry), its own
    subpackage, since the namespace may already exist through another distribution."""
    with zipfile.ZipFile(whl) as z:
        names = [n for n in z.namelist() if not n.split("/")[0].endswith((".dist-info", ".data"))]
    tops = set()
    for n in names:
        parts = n.split("/")
        depth = 2 if len(parts) > 2 and f"{parts[0]}/__init__.py" not in names else 1
        t = ".".join(parts[:depth])
        tops.add(t[:-3] if t.endswith(".py") else t)
    public = {t for t in tops if not t.split(".")[-1].startswith("_") and not t.endswith((".so", ".pyi", ".typed"))}
    return public or tops


def pip_install(wheels: list[str], *extra: str) -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--no-compile",
            *extra,
            "--target",
            SITE,
            *wheels,
        ],
        check=True,
    )


def main() -> None:
    if not DRY and not Path(SITE, "ray", "serve").exists():
        with tarfile.open(next(HERE.glob("ray-serve-*.tar.xz"))) as t:
            t.extractall(SITE)
    missing = [str(w) for w in sorted(HERE.glob("*.whl")) if not all(importable(t) for t in import_names(w))]
    if missing and not DRY:
        pip_install(missing)
    print("serve bundle: installed", len(missing), "wheels:", " ".join(Path(m).name.split("-")[0] for m in missing))
    # Serve's gRPC proxy imports generated code that pins grpcio/protobuf versions at import time: when the
    # image's own do not fit, the fallback's grpcio, reflection and protobuf shadow them.
    check = [sys.executable, "-c", "import ray.serve._private.grpc_util"]
    if DRY or subprocess.run(check, capture_output=True).returncode == 0:
        return
    pip_install([str(w) for w in sorted((HERE / "fallback").glob("*.whl"))], "--upgrade")
    ok = subprocess.run(check, capture_output=True, text=True)
    print("serve bundle: fallback grpcio/protobuf installed;", "import ok" if ok.returncode == 0 else ok.stderr[-500:])


if __name__ == "__main__":
    main()
