#!/usr/bin/env bash
# Run ON the GPU machine (the device tool's `run`, from the repository root, with .whl carried:
# scripts/gpu/fetch_wheels.sh makes it). Installs nothing system-wide: the carried wheels go to
# /tmp/site, afd runs from this checkout. Then: the GPU's name and memory, tests/gpu (every
# family against transformers on cuda, the mixed-device topologies, the KV plan, grouped
# experts), and `afd bench gpu` (decode tok/s at batch 1, 32 and 256 against transformers on the
# same GPU; the Step-3 MFA layer at batch 256, 8K context). Full logs and the JSON go to $OUT.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/afd-gpu-out}
mkdir -p "$OUT"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(), '| transformers', transformers.__version__)" || exit 1
timeout 300 python3 -m pytest -q -p no:cacheprovider -o addopts="" tests/gpu -rfs 2>&1 \
    | tee "$OUT/tests_gpu.log" | tail -25
timeout 230 python3 -m afd_cli --log-level WARNING bench gpu --cache-dir /tmp/afd-cache \
    >"$OUT/bench_gpu.json" 2>"$OUT/bench_gpu.err"
echo "bench exit $?"; tail -5 "$OUT/bench_gpu.err"; cat "$OUT/bench_gpu.json"
