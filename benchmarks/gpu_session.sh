#!/bin/bash
# The GPU checks of one session, in one call of the device tool. Sections (default: wave3):
#   overlap the GPU tier and the 6.58B offloaded step overlapped with the next forward against inline (issue 38)
#   wave3   the GPU tier (tests/gpu), the 873M/110M table beside plain and FSDP2 (the stage 3 ratio after the
#           wave-3 changes), and activation checkpoints with and without cpu_checkpointing when the script is
#           there (about 330 s on an H200)
#   offload issue 18/19's offload runs: the host step, 1.75B and 6.58B against FSDP2, the 6.58B profile (about 460 s)
#   ds      issue 38: DeepSpeed 0.19.8 beside ours: its cpu_adam JIT-built once (timed), the host step against its
#           compiled CPU Adam at 16 threads and 1, and 6.58B ZeRO-Offload against ours and FSDP2's
#           CPUOffloadPolicy in the same call (about 300 s on an H200; each part bounded by timeout: 480 s at most)
#   hoststep issue 38's host step after its chunks were resized: ds's build and host step against DeepSpeed's CPU
#           Adam, then the 1.75B inline offloaded step with the engine's chunks and with 8M-element ones (the
#           size before), in that order (about 220 s on an H200; 300 s at most)
#   diag    issue 38: the fused kernel on a second thread, then 1.75B and 6.58B inline against overlapped (220 s)
#   check   issue 38: the GPU tier, then 1.75B inline / overlapped / started during backward (160 s)
#   final   issue 38: 6.58B inline / default / started during backward / FSDP2, the tier, DeepSpeed's CPU Adam
#           against our host step, the delayed update at 1.75B 32x1024 if time is left (410 s)
#   largest issue 38: the largest GPT the host memory holds with offload_optimizer cpu, 10 steps (120 s)
#   bandwidth issue 38: is the host step bound by host memory bandwidth (benchmarks.host_bandwidth)? Then 1.75B
#           inline / overlapped / started during backward with the thread's timeline, the latter with 16 threads
#           and with one copy stream, and the delayed update at 32x1024 (about 280 s)
#   sidebyside issue 38: DeepSpeed's cpu_adam built (the GPU tier beside it), the delayed update at 1.75B 32x1024,
#           6.58B started during backward / inline / DeepSpeed / FSDP2 in one call, then the largest model if
#           time is left (560 s)
#   kernel  issue 38, host_kernel: compiled: 6.58B inline and started during backward with the compiled kernel
#           (each process 200 s at most, its progress printed if cut), then the GPU tier if 150 s are left (540 s
#           at most: one call, with a timeout_s of 580)
#   settle  issue 38, what is left: the GPU tier alone, 6.58B inline and started during backward taking turns
#           twice (the 1.10x ratio, which two calls put at 1.17x and 0.95x), 1.75B at stage 2 inline and started
#           during backward, the largest model for 10 steps (490 s)
# Results land in $OUT.
#
# The device image has torch, lightning and accelerate but not jsonargparse (LightningCLI). Before the call, here:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 -d .whl jsonargparse==4.53.0 docstring_parser==0.18.0 typeshed_client==2.15.0
# For `ds` also DeepSpeed (a pure-Python wheel: DS_BUILD_OPS=0 pip wheel --no-deps --no-build-isolation
# deepspeed==0.19.8) and what it needs that the image lacks, the same way (--python-version 3.12, manylinux):
#   hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
#   typing-extensions==4.16.0   (pydantic 2.14 needs >= 4.16; the image's is older or unknown)
# DeepSpeed is never a dependency of the project.
# then run `bash benchmarks/gpu_session.sh [wave3|offload|ds|hoststep|diag|check|final|largest|bandwidth|sidebyside|settle|kernel]`
# with `.whl` in the
# call's carry.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site
OUT=${OUT:-gpu_session_out}
mkdir -p "$OUT"
T0=$(date +%s)
step() { echo "=== $1 (t=$(( $(date +%s) - T0 ))s)"; }
SECTION=${1:-wave3}
# DeepSpeed (issue 38's comparisons, never a dependency): its environment, and its cpu_adam op built once
ds_env() {
  NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
  export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(readlink -f "$NVCC")")")}
  # cpu_adam is built by DeepSpeed's CPU op builder (g++, ninja, -march=native) even with the cuda accelerator;
  # DS_SKIP_CUDA_CHECK only matters to its CUDA ops (nvcc 13.0 against torch's cu130 match anyway).
  export DS_ACCELERATOR=${DS_ACCELERATOR:-cuda} TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 DS_SKIP_CUDA_CHECK=1 \
    TORCH_EXTENSIONS_DIR=/tmp/torch_extensions
}
ds_build() {
  # Bytecode now (the install skips it), so DeepSpeed's setup does not include compiling its modules
  timeout 60 python3 -m compileall -q -j 0 /tmp/site >/dev/null; echo "compileall rc=$? (t=$(( $(date +%s) - T0 ))s)"
  timeout 150 python3 -c "
import time; start = time.perf_counter()
import torch, deepspeed
from deepspeed.ops.op_builder import CPUAdamBuilder
print(f'torch {torch.__version__} (CUDA {torch.version.cuda}), deepspeed {deepspeed.__version__}', deepspeed.__file__)
built = time.perf_counter()
CPUAdamBuilder().load(verbose=False)
print(f'DeepSpeed cpu_adam built in {time.perf_counter() - built:.1f} s (imports {built - start:.1f} s)')"
}
# The GPU tier alone (about 110 s on an H200 before the compiled-kernel cases), at most 240 s
tier_alone() {
  { step tests; nvidia-smi -L; timeout 240 python3 -m pytest tests/gpu -q -rP -p no:cacheprovider --timeout 230
    echo "rc=$?"; } 2>&1 | tee "$OUT/tests.txt" | tail -8
}
# The delayed update where forward+backward is at least the host step (1.75B, batch 32x1024), inline against
# delayed, if more than 60 s of the section's budget (left()) is left
delayed_b32_if_time() {
  [ $(left) -gt 60 ] || return 0
  { step delayed_1_75B_b32; timeout $(left) python3 -m benchmarks.gpu_offload --layers 8 --batch-size 32 --steps 3 \
      --warmup 3 --impls zero3_inline zero3_delayed --timeout $(( $(left) / 2 )); echo "rc=$?"; } 2>&1 \
    | tee "$OUT/delayed_1_75B_b32.txt"
}
# The largest model for 10 steps (LARGEST_LAYERS deep, 34 by default: 6.99B) if more than 100 s of the section's
# budget (left()) is left
largest_if_time() {
  local L=${LARGEST_LAYERS:-34}
  [ $(left) -gt 100 ] || return 0
  { step largest_$L; free -g | head -2; timeout $(( $(left) - 5 )) python3 -m benchmarks.gpu_offload --layers $L \
      --steps 10 --warmup 1 --impls zero3_overlap_bwd --timeout $(( $(left) - 10 )) --json "$OUT/largest_$L.json"
    echo "rc=$?"; } 2>&1 | tee "$OUT/largest_$L.txt"
}
if [ "$SECTION" = largest ]; then
# Issue 38: the largest GPT the machine holds with offload_optimizer: cpu, for 10 steps. Host memory is the limit:
# about 16 bytes per parameter (12 of fp32 masters and Adam state, 4 of fp32 gradients); 6.58B (32 layers) peaked
# at 99.5 GiB RSS, so 34 layers (6.99B) needs about 105 GiB and 36 (7.39B) about 112 GiB of the 128 GiB host.
# LARGEST_LAYERS sets the depth (about 120 s on an H200 at 34 layers). LARGEST_IMPL=zero3_overlap_bwd_compiled
# steps with host_kernel: compiled, whose host gradient buffers are bf16: 14 bytes per parameter, so 38 layers
# (7.79B) should need about 102 GiB
L=${LARGEST_LAYERS:-34}
IMPL=${LARGEST_IMPL:-zero3}
{ step largest_$L; free -g | head -2; timeout 300 python3 -m benchmarks.gpu_offload --layers $L --steps 10 --warmup 1 \
    --impls $IMPL --timeout 290 --json "$OUT/largest_$L.json"; echo "rc=$?"; step end; } 2>&1 | tee "$OUT/largest_$L.txt"
exit 0
fi
if [ "$SECTION" = bandwidth ]; then
BUDGET=${BANDWIDTH_BUDGET:-290}
left() { echo $(( BUDGET - $(date +%s) + T0 )); }
# Expected: ~40 s (16 GB of tensors, the kernel alone and beside copies each way, at 16 and 15 threads)
{ step host_bandwidth; nproc; timeout 80 python3 -m benchmarks.host_bandwidth; echo "rc=$?"; } 2>&1 | tee "$OUT/host_bandwidth.txt"
# Expected: ~70 s (setup ~7 s, 6 steps of ~0.6 s, exit; three processes)
{ step timeline_1_75B; timeout 110 python3 -m benchmarks.gpu_offload --layers 8 --steps 3 --warmup 3 \
    --impls zero3_inline zero3_overlap zero3_overlap_bwd --timeout 36; echo "rc=$?"; } 2>&1 | tee "$OUT/timeline_1_75B.txt"
{ step timeline_1_75B_16threads; timeout 40 python3 -m benchmarks.gpu_offload --layers 8 --steps 3 --warmup 3 \
    --impls zero3_overlap_bwd --overlap-threads 16 --timeout 36; echo "rc=$?"; } 2>&1 | tee "$OUT/timeline_1_75B_16threads.txt"
{ step timeline_1_75B_one_stream; timeout 40 python3 -m benchmarks.gpu_offload --layers 8 --steps 3 --warmup 3 \
    --impls zero3_overlap_bwd --one-copy-stream --timeout 36; echo "rc=$?"; } 2>&1 | tee "$OUT/timeline_1_75B_one_stream.txt"
delayed_b32_if_time
step end
exit 0
fi
if [ "$SECTION" = sidebyside ]; then
BUDGET=${SIDEBYSIDE_BUDGET:-560}
left() { echo $(( BUDGET - $(date +%s) + T0 )); }
ds_env
# DeepSpeed's cpu_adam (~50 s) builds while the GPU tier runs (SIDEBYSIDE_TIER=0: the build alone)
( ds_build; echo "build rc=$?" ) > "$OUT/ds_build.txt" 2>&1 &
BUILD=$!
if [ "${SIDEBYSIDE_TIER:-1}" = 1 ]; then
{ step tests; nvidia-smi -L; timeout 120 python3 -m pytest tests/gpu -q -p no:cacheprovider --timeout 110; echo "rc=$?"; } 2>&1 | tee "$OUT/tests.txt" | tail -8
fi
wait $BUILD; tail -2 "$OUT/ds_build.txt"
if ! grep -q "build rc=0" "$OUT/ds_build.txt"; then echo "DeepSpeed's cpu_adam did not build: measuring without it"
  mv /tmp/site/deepspeed /tmp/site/deepspeed.unbuilt; fi
# Expected: ~60 s: the delayed update where forward+backward (0.68 s) is at least the host step (0.48 s)
{ step delayed_1_75B_b32; timeout 90 python3 -m benchmarks.gpu_offload --layers 8 --batch-size 32 --steps 3 --warmup 3 \
    --impls zero3_inline zero3_delayed --timeout 44; echo "rc=$?"; } 2>&1 | tee "$OUT/delayed_1_75B_b32.txt"
# Expected: ~340 s: ours ~50 s each, DeepSpeed ~150 s (its setup with 52 GB of pinned fp32 state), FSDP2 ~85 s; in
# that order, so a run cut short loses FSDP2's row (measured last session at 2.70 s) first
{ step sidebyside_6_58B; timeout $(( $(left) - 5 )) python3 -m benchmarks.gpu_offload --layers 32 --steps 3 --warmup 2 \
    --impls zero3_overlap_bwd zero3_inline deepspeed fsdp2 --timeout 160 --json "$OUT/sidebyside_6_58B.json"; \
  echo "rc=$?"; } 2>&1 | tee "$OUT/sidebyside_6_58B.txt"
largest_if_time
step end
exit 0
fi
if [ "$SECTION" = settle ]; then
BUDGET=${SETTLE_BUDGET:-490}
left() { echo $(( BUDGET - $(date +%s) + T0 )); }
# Expected: ~100 s (the last call cut it at 120 s while DeepSpeed's build shared the cores)
tier_alone
# Expected: ~220 s (four processes of ~55 s: setup ~15 s, 5 steps of ~2-2.7 s, exit)
{ step settle_6_58B; timeout $(( $(left) - 5 )) python3 -m benchmarks.gpu_offload --layers 32 --steps 3 --warmup 2 \
    --impls zero3_inline zero3_overlap_bwd zero3_inline zero3_overlap_bwd --timeout 90 \
    --json "$OUT/settle_6_58B.json"; echo "rc=$?"; } 2>&1 | tee "$OUT/settle_6_58B.txt"
# Expected: ~50 s: stage 2 with each reduce bucket's host step started during backward, against inline
{ step stage2_1_75B; timeout 100 python3 -m benchmarks.gpu_offload --layers 8 --steps 3 --warmup 3 \
    --impls zero2_inline zero2_overlap_bwd --timeout 48; echo "rc=$?"; } 2>&1 | tee "$OUT/stage2_1_75B.txt"
largest_if_time
step end
exit 0
fi
if [ "$SECTION" = kernel ]; then
# Issue 38, offload_optimizer.host_kernel: compiled (the torch.compile'd host step that reads bf16 gradients), about
# 540 s on an H200. Session 50 measured the kernel alone (compiled_host_step.txt: 0.84-0.92x the fused kernel's
# time on the host's cores), setup's peak at 1.75B and the fused rows at 6.58B; both compiled 6.58B processes ran
# past their timeouts (70 s, then 125 s) without saying where. So first the compiled rows at 6.58B, each process
# given 200 s and printing its progress when cut (setup, with the kernel's cold build of 30-50 s, then each step),
# inline and started during backward (the 1.10x ratio with 32 bytes per element moved instead of 36); then the
# GPU tier with what is left (about 170 s; its compiled-kernel cases included).
BUDGET=${KERNEL_BUDGET:-540}
left() { echo $(( BUDGET - $(date +%s) + T0 )); }
{ step kernel_6_58B; free -g | head -2; timeout 420 python3 -m benchmarks.gpu_offload --layers 32 --steps 3 \
    --warmup 2 --impls zero3_inline_compiled zero3_overlap_bwd_compiled --timeout 200 \
    --json "$OUT/kernel_6_58B.json"; echo "rc=$?"; } 2>&1 | tee "$OUT/kernel_6_58B.txt"
if [ "$(left)" -gt 150 ]; then
{ step tests; nvidia-smi -L; timeout $(( $(left) - 5 )) python3 -m pytest tests/gpu -q -rP -p no:cacheprovider \
    --timeout $(( $(left) - 10 )); echo "rc=$?"; } 2>&1 | grep -v DEBUG | tee "$OUT/tests.txt" | tail -8
fi
step end
exit 0
fi
if [ "$SECTION" = check ]; then
# Issue 38, before the last call (about 160 s on an H200): the GPU tier (the step started during backward against
# the inline step, bit for bit), then 1.75B inline, overlapped with the forward, and started during backward
{ step tests; nvidia-smi -L; timeout 150 python3 -m pytest tests/gpu -q -p no:cacheprovider --timeout 140; echo "rc=$?"; } 2>&1 | tee "$OUT/tests.txt" | tail -25
{ step overlap_1_75B; timeout 110 python3 -m benchmarks.gpu_offload --layers 8 --steps 3 --warmup 3 --impls zero3_inline zero3_overlap zero3_overlap_bwd --timeout 36; echo "rc=$?"; step end; } 2>&1 | tee "$OUT/overlap_1_75B.txt"
exit 0
fi
if [ "$SECTION" = final ]; then
# Issue 38, the last call (about 420 s on an H200; each part bounded by what is left of FINAL_BUDGET): 6.58B
# inline, the default (overlapped with the forward), started during backward and FSDP2's CPUOffloadPolicy in one
# call; the GPU tier (the overlap on by default); the host step against DeepSpeed's CPU Adam (its cpu_adam built
# first); with time left, the delayed update where forward+backward is at least the host step (1.75B, 32x1024)
BUDGET=${FINAL_BUDGET:-410}
left() { echo $(( BUDGET - $(date +%s) + T0 )); }
{ step offload7B; timeout 300 python3 -m benchmarks.gpu_offload --layers 32 --steps 3 --warmup 3 \
    --impls zero3_inline zero3 zero3_overlap_bwd fsdp2 --timeout 85 --json "$OUT/offload_7B.json"; echo "rc=$?"; } 2>&1 | tee "$OUT/offload_7B.txt"
ds_env
# DeepSpeed's cpu_adam builds on the host's cores while the GPU tier runs (the tier checks results, not times)
( ds_build; echo "build rc=$?" ) > "$OUT/ds_build.txt" 2>&1 &
BUILD=$!
{ step tests; timeout 120 python3 -m pytest tests/gpu -q -p no:cacheprovider --timeout 110; echo "rc=$?"; } 2>&1 | tee "$OUT/tests.txt" | tail -8
wait $BUILD; tail -2 "$OUT/ds_build.txt"
if [ $(left) -gt 45 ]; then
{ step ds_host_step; timeout $(( $(left) - 5 )) python3 -m benchmarks.gpu_host_step --deepspeed --numel 2e7 2e8 \
    --threads 16 1 --repeats 5 --timeout $(( ($(left) - 10) / 2 )); echo "rc=$?"; } 2>&1 | tee "$OUT/ds_host_step.txt"
fi
delayed_b32_if_time
step end
exit 0
fi
if [ "$SECTION" = diag ]; then
# Issue 38: why the overlapped host step ran slower on its thread (about 220 s on an H200): the fused kernel on a
# second thread against the training thread's, idle, in a CUDA synchronise, or launching kernels; then 1.75B and
# 6.58B inline against overlapped, with the thread's own time and the forward's waits
{ step step_on_thread; timeout 60 python3 -m benchmarks.step_on_thread; echo "rc=$?"; } 2>&1 | tee "$OUT/step_on_thread.txt"
{ step overlap_1_75B; timeout 90 python3 -m benchmarks.gpu_offload --layers 8 --steps 3 --warmup 2 --impls zero3_inline zero3_overlap --timeout 44; echo "rc=$?"; } 2>&1 | tee "$OUT/overlap_1_75B.txt"
{ step overlap_6_58B; timeout 150 python3 -m benchmarks.gpu_offload --layers 32 --steps 3 --warmup 2 --impls zero3_inline zero3_overlap --timeout 74; echo "rc=$?"; step end; } 2>&1 | tee "$OUT/overlap_6_58B.txt"
exit 0
fi
if [ "$SECTION" = overlap ]; then
# Issue 38's exact overlap on a GPU: the GPU tier (its overlap tests against the inline step), then 6.58B with
# the step overlapped (zero3) and inline (zero3_inline) in one call (about 330 s on an H200 in all)
{ step tests; nvidia-smi -L; timeout 200 python3 -m pytest tests/gpu -q -p no:cacheprovider --timeout 190; echo "rc=$?"; } 2>&1 | tee "$OUT/tests.txt" | tail -25
{ step activation_checkpoints; timeout 90 python3 -m benchmarks.gpu_activation_checkpoints --out "$OUT/activation_checkpoints.json"; echo "rc=$?"; } 2>&1 | tee "$OUT/activation_checkpoints.txt"
# OVERLAP_LAYERS=8: 1.75B, about 60 s for the pair; 32 (the default): 6.58B, about 120 s
L=${OVERLAP_LAYERS:-32}
{ step offload_overlap_$L; timeout 260 python3 -m benchmarks.gpu_offload --layers $L --steps 3 --warmup 2 --impls zero3_overlap zero3_inline --timeout 125; echo "rc=$?"; step end; } 2>&1 | tee "$OUT/offload_overlap_$L.txt"
exit 0
fi
if [ "$SECTION" = ds ] || [ "$SECTION" = hoststep ]; then
ds_env
# Sizes (a dry run on a CPU machine passes smaller ones, and DS_ACCELERATOR=cpu)
DS_HOST_ARGS=${DS_HOST_ARGS:---numel 2e7 2e8 --threads 16 1}
DS_MODEL_ARGS=${DS_MODEL_ARGS:---layers 32}
# Expected: ~40 s (two C++ files on 16 cores, DeepSpeed's import and CPU probe; 55 s on a quiet 2-core machine)
{ step ds_build; echo "CUDA_HOME=$CUDA_HOME"; g++ --version | head -1; "$NVCC" --version | tail -1
  ds_build; rc=$?; echo "rc=$rc"; echo $rc > /tmp/ds_build.rc; } 2>&1 | tee "$OUT/ds_build.txt" | tail -8
# A failed or killed build (its lock left behind would stall every later load): DeepSpeed out of the way, so the
# rest says "deepspeed not importable" in one line and measures ours and torch's, FSDP2's
if [ "$(cat /tmp/ds_build.rc)" != 0 ]; then echo "DeepSpeed's cpu_adam did not build: measuring without it"
  mv /tmp/site/deepspeed /tmp/site/deepspeed.unbuilt; fi
# Expected: ~30 s (a process per thread count: imports, 3.2 GB of tensors, 6 steps of each of the four)
{ step ds_host_step; timeout 60 python3 -m benchmarks.gpu_host_step --deepspeed $DS_HOST_ARGS \
    --repeats 5 --timeout 29; echo "rc=$?"; } 2>&1 | tee "$OUT/ds_host_step.txt"
if [ "$SECTION" = hoststep ]; then
# Expected: ~50 s each (setup ~18 s, 5 steps of ~0.7 s, exit): the engine's inline host step at 1.75B with its
# chunks (chunk_numel: 20 of ~88M elements) against the 8M-element chunks it used before (209 chunks)
{ step hoststep_1_75B; timeout 100 python3 -m benchmarks.gpu_offload --layers 8 --steps 3 --warmup 2 \
    --impls zero3_inline --timeout 90; echo "rc=$?"; } 2>&1 | tee "$OUT/hoststep_1_75B.txt"
{ step hoststep_1_75B_8M; timeout 100 python3 -m benchmarks.gpu_offload --layers 8 --steps 3 --warmup 2 \
    --impls zero3_inline --chunk 8388608 --timeout 90; echo "rc=$?"; step end; } 2>&1 | tee "$OUT/hoststep_1_75B_8M.txt"
exit 0
fi
# Expected: ~330 s: ours (the default, started during backward, inline) ~50 s each and FSDP2 ~65 s (setup 18 s
# and 28 s, 5 steps of ~2.3 s, exit), DeepSpeed ~100 s (its ZeRO-3 setup with 26 GB of pinned fp32 masters and gradients, 52 GB of Adam
# state made at the first step). DeepSpeed before FSDP2 (measured before at 2.43 s a step): if time runs out,
# FSDP2's row is the one lost. Two warm-up steps: the first overlapped step's own call is short.
{ step ds_offload7B; timeout 400 python3 -m benchmarks.gpu_offload $DS_MODEL_ARGS --steps 3 --warmup 2 \
    --impls zero3 zero3_overlap_bwd zero3_inline deepspeed fsdp2 --timeout 150 --json "$OUT/ds_offload_7B.json"; echo "rc=$?"; } 2>&1 \
  | tee "$OUT/ds_offload_7B.txt"
# The delayed update's target (issue 38) where the GPU's forward+backward is at least the host step: 1.75B at
# batch 8x1024, inline against delayed, if the call has time left (about 70 s)
LEFT=$(( ${DS_SECTION_BUDGET:-545} - $(date +%s) + T0 ))
if [ $LEFT -gt 60 ]; then
{ step delayed_1_75B_b8; timeout $LEFT python3 -m benchmarks.gpu_offload --layers 8 --batch-size 8 --steps 3 --warmup 3 \
    --impls zero3_inline zero3_delayed --timeout $(( LEFT / 2 )); echo "rc=$?"; } 2>&1 | tee "$OUT/delayed_1_75B_b8.txt"
fi
step end
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
