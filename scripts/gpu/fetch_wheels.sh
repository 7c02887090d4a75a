#!/usr/bin/env bash
# Run HERE (a machine that reaches the package registries), before scripts/gpu/check.sh runs on
# a GPU machine: downloads into .whl/ the wheels afd needs that the GPU machine's image lacks or
# holds in other versions (its python3 is 3.12 with torch and transformers of its own; nothing
# can be fetched there). The versions are this checkout's venv's, so the protobuf modules built
# there match the grpcio they are checked against, and transformers finds the regex it checks
# for at import. Then, with the device tool:
#   run(command="bash scripts/gpu/check.sh", carry=[".whl"], timeout_s=600)
set -euo pipefail
cd "$(dirname "$0")/../.."
PKGS=(pyzmq grpcio grpcio-tools protobuf transformers regex fastapi starlette pydantic pydantic-core
      annotated-types typing-inspection uvicorn httptools)
py=${PYTHON:-python3}
pins=()
for p in "${PKGS[@]}"; do
    v=$("$py" -m pip show "$p" 2>/dev/null | awk '/^Version:/{print $2}')
    [ -n "$v" ] || { echo "error: $p is not installed in $py's environment" >&2; exit 2; }
    pins+=("$p==$v")
done
rm -rf .whl && mkdir .whl
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "${pins[@]}"
du -sh .whl && ls .whl
