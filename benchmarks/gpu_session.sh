#!/bin/bash
# The GPU checks of one session, in one call of the device tool. Sections (default: wave3):
#   overlap the GPU tier and the 6.58B offloaded step overlapped with the next forward against inline (issue 38)
#   wave3   the GPU tier (tests/gpu), the 873M/110M table beside plain and FSDP2 (the stage 3 ratio after the
#           wave-3 changes), and activation checkpoints with and without cpu_checkpointing when the script is
#           there (about 330 s on an H200)
#   offload issue 18/19's offload runs: the host step, 1.75B and 6.58B against FSDP2, the 6.58B profile (about 460 s)
# Results land in $OUT.
#
# The device image has torch, lightning and accelerate but not jsonargparse (LightningCLI). Before the call, here:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 -d .whl jsonargparse==4.53.0 docstring_parser==0.18.0 typeshed_client==2.15.0
# then run `bash benchmarks/gpu_session.sh [wave3|offload]` with `.whl` in the call's carry.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site
OUT=${OUT:-gpu_session_out}
mkdir -p "$OUT"
T0=$(date +%s)
step() { echo "=== $1 (t=$(( $(date +%s) - T0 ))s)"; }
SECTION=${1:-wave3}
if [ "$SECTION" = overlap ]; then
# Issue 38's exact overlap on a GPU: the GPU tier (its overlap tests against overlap_step false), then 6.58B with
# the step overlapped (zero3) and inline (zero3_inline) in one call (about 330 s on an H200 in all)
{ step tests; nvidia-smi -L; timeout 200 python3 -m pytest tests/gpu -q -p no:cacheprovider --timeout 190; echo "rc=$?"; } 2>&1 | tee "$OUT/tests.txt" | tail -25
{ step activation_checkpoints; timeout 90 python3 -m benchmarks.gpu_activation_checkpoints --out "$OUT/activation_checkpoints.json"; echo "rc=$?"; } 2>&1 | tee "$OUT/activation_checkpoints.txt"
# OVERLAP_LAYERS=8: 1.75B, about 60 s for the pair; 32 (the default): 6.58B, about 120 s
L=${OVERLAP_LAYERS:-32}
{ step offload_overlap_$L; timeout 260 python3 -m benchmarks.gpu_offload --layers $L --steps 3 --warmup 2 --impls zero3 zero3_inline --timeout 125; echo "rc=$?"; step end; } 2>&1 | tee "$OUT/offload_overlap_$L.txt"
exit 0
fi
if [ "$SECTION" = wave3 ]; then
{ step tests; nvidia-smi -L; timeout 200 python3 -m pytest tests/gpu -q -p no:cacheprovider --timeout 190; echo "rc=$?"; } 2>&1 | tee "$OUT/tests.txt" | tail -25
{ step table; timeout 100 python3 -m benchmarks.gpu --preset 873M 110M --steps 8 --warmup 3 --repeats 2; echo "rc=$?"; } 2>&1 | tee "$OUT/table.txt"
if [ -f benchmarks/gpu_activation_checkpoints.py ]; then
{ step activation_checkpoints; timeout 90 python3 -m benchmarks.gpu_activation_checkpoints --out "$OUT/activation_checkpoints.json"; echo "rc=$?"; } 2>&1 | tee "$OUT/activation_checkpoints.txt"
fi
step end
exit 0
fi
{ step tests; nvidia-smi -L; timeout 120 python3 -m pytest tests/gpu -q -p no:cacheprovider --timeout 115; echo "rc=$?"; } 2>&1 | tee "$OUT/tests.txt" | tail -25
# (The CPU tier's Accelerate launches hide GPUs: with one visible, their two ranks fail in Accelerate's own barrier
# on a one-GPU machine, measured 2026-11-26; docs/benchmarks.md. The GPU tier launches on the GPU itself.)
{ step table; timeout 90 python3 -m benchmarks.gpu --preset 873M 110M --steps 8 --warmup 3 --repeats 2; echo "rc=$?"; } 2>&1 | tee "$OUT/table.txt"
{ step memory; timeout 70 python3 -m benchmarks.gpu_memory "$OUT/memory_873M.txt" --preset 873M --steps 2 >/dev/null; echo "rc=$?"; } 2>&1
{ step host_step; timeout 60 python3 -m benchmarks.gpu_host_step --numel 1.75e9; echo "rc=$?"; } 2>&1 | tee "$OUT/host_step.txt"
{ step offload; timeout 130 python3 -m benchmarks.gpu_offload --layers 8 --steps 2 --warmup 1 --profile --timeout 60; echo "rc=$?"; } 2>&1 | tee "$OUT/offload.txt"
# The 6.58B host step under the profiler (where its 1.69 s go: the fused kernel's chunks, and the rest): about 60 s
{ step offload7B_profile; timeout 90 python3 -m benchmarks.gpu_offload --layers 32 --steps 2 --warmup 1 --impls zero3 --profile --timeout 85; echo "rc=$?"; } 2>&1 | tee "$OUT/offload_7B_profile.txt"
# 6.58B, ours and FSDP2 side by side (FSDP2's setup alone takes about 27 s): about 150 s
{ step offload7B; timeout 260 python3 -m benchmarks.gpu_offload --layers 32 --steps 2 --warmup 1 --impls zero3 fsdp2 --timeout 120; echo "rc=$?"; step end; } 2>&1 | tee "$OUT/offload_7B.txt"
