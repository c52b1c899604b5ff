#!/bin/bash
# Every GPU check of issues 18 and 19 in one call of the device tool (about 250 s of run time on an H200):
# the GPU tier, issue 18's table, where the memory goes, offload against FSDP2 at 1.75B and 6.58B parameters.
# Results land in $OUT.
#
# The device image has torch, lightning and accelerate but not jsonargparse (LightningCLI). Before the call, here:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 -d .whl jsonargparse==4.53.0 docstring_parser==0.18.0 typeshed_client==2.15.0
# then run `bash benchmarks/gpu_session.sh` with `.whl` in the call's carry.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site
OUT=${OUT:-gpu_session_out}
mkdir -p "$OUT"
T0=$(date +%s)
step() { echo "=== $1 (t=$(( $(date +%s) - T0 ))s)"; }
{ step tests; nvidia-smi -L; timeout 120 python3 -m pytest tests/gpu -q -p no:cacheprovider --timeout 115; echo "rc=$?"; } 2>&1 | tee "$OUT/tests.txt" | tail -25
{ step table; timeout 90 python3 -m benchmarks.gpu --preset 873M 110M --steps 8 --warmup 3 --repeats 2; echo "rc=$?"; } 2>&1 | tee "$OUT/table.txt"
{ step memory; timeout 70 python3 -m benchmarks.gpu_memory "$OUT/memory_873M.txt" --preset 873M --steps 2 >/dev/null; echo "rc=$?"; } 2>&1
{ step offload; timeout 130 python3 -m benchmarks.gpu_offload --layers 8 --steps 2 --warmup 1 --profile --timeout 42; echo "rc=$?"; } 2>&1 | tee "$OUT/offload.txt"
{ step offload7B; timeout 400 python3 -m benchmarks.gpu_offload --layers 32 --steps 2 --warmup 1 --timeout 130; echo "rc=$?"; step end; } 2>&1 | tee "$OUT/offload_7B.txt"
