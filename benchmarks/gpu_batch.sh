#!/usr/bin/env bash
# Everything pipelang has to show on a GPU, in one call of the device tool (one start-up):
# the CUDA tests, then the local backend against one process with each rank's saved
# activations (issue 6), then graph replay against eager steps (issue 14). The CUDA tests
# include a plan made from this GPU's own profile, run end to end (issue 20). Logs and the
# rewritten RESULTS.md land in $OUT.
#
# Here, once (lark is the one dependency the GPU image lacks; docs/runtime.md, "On a GPU"):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps -d .whl lark==1.3.1   # pure Python: any platform
# Then: run(command="bash benchmarks/gpu_batch.sh", carry=[".whl"]).
set -uo pipefail
out=${OUT:-/tmp/pipelang-gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site . || exit 1
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
} > "$out/device.txt" 2>&1
status=0
python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py 2>&1 | tee "$out/pytest_gpu.log"
status=$((status | PIPESTATUS[0]))
python3 benchmarks/local_vs_reference.py 2>&1 | tee "$out/local_vs_reference.log"
status=$((status | PIPESTATUS[0]))
python3 benchmarks/graphs_vs_eager.py 2>&1 | tee "$out/graphs_vs_eager.log"
status=$((status | PIPESTATUS[0]))
cp benchmarks/RESULTS.md "$out/RESULTS.md"
exit "$status"
