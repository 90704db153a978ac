#!/usr/bin/env bash
# The GPU check (issue 38): one command, one device call, at most 8 minutes on an H100, the parts in
# order of importance, each skipped with a line when the budget would run out. See gpu_check.py.
#   bash benchmarks/gpu/gpu_check.sh                # on the GPU machine (python3 with a CUDA torch)
#   bash benchmarks/gpu/gpu_check.sh --dry-run      # every part's code path on the CPU, tiny sizes
# Results: $OUT (else ./gpu-out)/gpu_check.md (tables with device, torch, date, commit) and gpu_check.log.
# torchao (the fp8 part's peer) is used where importable: carry its wheel in .whl/ on the GPU machines,
# which have no network; it is installed to /tmp/site here when present.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
if ls .whl/*.whl >/dev/null 2>&1 && [[ " $* " != *" --dry-run "* ]]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
exec "$PY" benchmarks/gpu/gpu_check.py "$@"
