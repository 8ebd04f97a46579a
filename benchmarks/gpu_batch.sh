#!/usr/bin/env bash
# Everything pipelang has to show on a GPU, in one call of the device tool (one start-up),
# the most important first, each step under its own `timeout` so that the whole batch
# ends within 6 minutes on an H100, installs included (at most 20 + 140 + 80 + 90 s):
#
#   1. the CUDA tests, tests/test_gpu.py (a plan made from this GPU's own profile run end
#      to end among them)                                                  at most 140 s
#   2. graph replay against eager steps, benchmarks/graphs_vs_eager.py      at most  80 s
#   3. the local backend against one process with each rank's saved
#      activations, benchmarks/local_vs_reference.py                        at most  90 s
#
# Every step's log streams into $OUT as it runs, and each RESULTS.md section is copied to
# $OUT/RESULTS.md as soon as it is written (graphs_vs_eager writes one row at a time), so
# a run cut off by its time limit still returns what it measured. $OUT/steps.txt lists each
# step's exit status and seconds (124: its timeout ended it).
#
# Here, once (lark is the one dependency the GPU image lacks; docs/runtime.md, "On a GPU"):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps -d .whl lark==1.3.1   # pure Python: any platform
# Then: run(command="bash benchmarks/gpu_batch.sh", carry=[".whl"], timeout_s=400).
set -uo pipefail
out=${OUT:-/tmp/pipelang-gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
export PIPELANG_RESULTS_COPY="$out/RESULTS.md"
status=0

step() {  # step NAME SECONDS COMMAND...: run it under its timeout, log it, record it
    local name=$1 limit=$2
    shift 2
    local began=$SECONDS
    timeout --kill-after=5 "$limit" "$@" 2>&1 | tee "$out/$name.log"
    local code=${PIPESTATUS[0]}
    echo "$name exit $code after $((SECONDS - began)) s (limit $limit s)" | tee -a "$out/steps.txt"
    status=$((status | code))
    return "$code"
}

step install 20 bash -c '
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl &&
    PYTHONPATH=/tmp/site python3 -m pip install -q --no-index --no-deps --no-build-isolation \
        --target /tmp/site .' || exit 1
export PYTHONPATH=/tmp/site
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
} > "$out/device.txt" 2>&1
step pytest_gpu 140 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py
step graphs_vs_eager 80 python3 benchmarks/graphs_vs_eager.py
step local_vs_reference 90 python3 benchmarks/local_vs_reference.py --rounds 2
cp benchmarks/RESULTS.md "$out/RESULTS.md"
exit "$status"
