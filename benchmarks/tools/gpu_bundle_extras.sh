#!/usr/bin/env bash
# What the GPU image lacks beyond the slim Ray of ../shared/gpu/make-bundle.sh, added to its .gpu/ (run on
# the CPU machine after make-bundle.sh):
# - pyzmq (a kvray dependency: the shm transport's channels across nodes), a wheel in .gpu/ itself, which
#   bootstrap.sh installs with the others; py-spy likewise, for bench_serve.py --profile;
# - .gpu/serve/: Ray Serve (the slim Ray has no ray/serve, the image most of ray[serve]'s dependencies).
#   The serve suite (`python -m benchmarks serve`) starts with benchmarks.tools.gpu_serve_install, which
#   installs from there only what the image cannot import.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
dest="$root/.gpu/serve"
py=${PYTHON:-python3}
mkdir -p "$dest/fallback"
plat="--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
dl() { $py -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat "$@" \
  2>&1 | grep -v 'is ignored' || true; }
dl -d "$root/.gpu" "pyzmq==$($py -c "from importlib.metadata import version; print(version('pyzmq'))")"
# py-spy (a static binary in a wheel; bootstrap.sh puts /tmp/site/bin on PATH): bench_serve.py --profile.
dl -d "$root/.gpu" --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 "py-spy==0.4.3"
site=$($py -c "import ray, os; print(os.path.dirname(os.path.dirname(ray.__file__)))")
ver=$($py -c "import ray; print(ray.__version__)")
(cd "$site" && tar --exclude=__pycache__ -cf - ray/serve | xz -T0 -6 > "$dest/ray-serve-$ver.tar.xz")
# ray[serve]'s own dependencies (the GPU image already has Ray core's: msgpack, protobuf, click, requests...),
# at the versions this machine's ray[serve] runs with.
pkgs="aiohappyeyeballs aiohttp aiohttp-cors aiosignal annotated-doc annotated-types anyio attrs colorful fastapi
frozenlist google-api-core google-auth googleapis-common-protos grpcio httptools Jinja2 MarkupSafe multidict
opencensus opencensus-context opentelemetry-api opentelemetry-exporter-prometheus opentelemetry-proto
opentelemetry-sdk opentelemetry-semantic-conventions prometheus_client propcache pydantic pydantic_core
six sniffio starlette typing-inspection typing_extensions uvicorn uvloop watchfiles websockets yarl h11
pyasn1 pyasn1-modules proto-plus"
specs=""
for p in $pkgs; do
  v=$($py -c "from importlib.metadata import version; print(version('$p'))" 2>/dev/null) && specs="$specs $p==$v"
done
dl -d "$dest" $specs
# The H200 image has grpcio 1.84: reflection 1.84 fits it; the fallback shadows grpcio/protobuf when not.
rm -f "$dest"/grpcio-*.whl "$dest"/grpcio_reflection-*.whl
dl -d "$dest" grpcio-reflection==1.84.0
dl -d "$dest/fallback" grpcio==1.85.3 grpcio-reflection==1.85.1 protobuf==7.36.2
cp "$root/benchmarks/tools/gpu_serve_install.py" "$dest/install.py"
du -sh "$dest"
