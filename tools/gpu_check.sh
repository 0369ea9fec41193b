#!/usr/bin/env bash
# What a machine with an NVIDIA GPU checks and measures, in one command from the repository root:
#
#     tools/gpu_check.sh [kernels|engine|all] [OUTDIR]
#
# kernels: the Pallas GPU kernels compiled by Triton (not interpreted) against the plain-JAX reference,
#          every case of tests/test_kernels.py.
# engine:  the engine on the GPU against Hugging Face's greedy tokens and prefill logits
#          (tests/test_model_parity.py, float32 with the Pallas kernels), then bench/device.py (kernel
#          bandwidth, the engine benchmark with SmolLM2 and an 8B-shaped model, MBU and MFU), then
#          bench/step_profile.py (the 8B-shaped decode step's device time by op).
# Runs with the python3 on the PATH (a GPU VM's own JAX with its CUDA plugin); jaxcb from this tree.
# Each part has its own time limit so that one that hangs or fails leaves the others' figures; logs and
# device.json go to OUTDIR (default /tmp/jaxcb-gpu).
set -u
stage=${1:-all}
out=${2:-/tmp/jaxcb-gpu}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py=${PYTHON:-python3}
start=$(date +%s)
elapsed() { echo "[$(( $(date +%s) - start )) s] $*"; }

{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv 2>&1
  "$py" -c "import jax, jaxlib, sys; print('python', sys.version.split()[0], 'jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())" 2>&1
} | tee "$out/env.txt"

if [ "$stage" = kernels ] || [ "$stage" = all ]; then
  elapsed "kernels"
  # float32 references at float32 (XLA's GPU dots may otherwise round float32 operands to TF32).
  JAX_DEFAULT_MATMUL_PRECISION=highest timeout 240 "$py" -m pytest -q -p no:cacheprovider --timeout 200 -k "gpu and not lower" tests/test_kernels.py \
    2>&1 | tee "$out/kernels.log" | tail -25
fi

if [ "$stage" = engine ] || [ "$stage" = all ]; then
  elapsed "parity"
  JAX_DEFAULT_MATMUL_PRECISION=highest timeout 150 "$py" -m pytest -q -p no:cacheprovider --timeout 140 -s tests/test_model_parity.py \
    2>&1 | tee "$out/parity.log" | grep -E "passed|failed|error|Error|worst|identical|assert" | tail -25
  elapsed "bench.device"
  timeout 420 "$py" -m bench.device --json "$out/device.json" 2>&1 | tee "$out/device.log" | tail -30
  elapsed "bench.step_profile"
  timeout 120 "$py" -m bench.step_profile 2>&1 | tee "$out/profile.log" | grep -v Warning | tail -22
  # The open problem of the first H200 run: XLA:GPU copied each layer's slice of the stacked weights
  # before its Triton dot (6.5 of 13.7 ms at 1 row). Candidates that need only flags: cuBLAS dots, which
  # the dynamic-slice fusion lets read the stack at the layer's offset.
  for flags in "--xla_gpu_enable_triton_gemm=false" \
               "--xla_gpu_enable_triton_gemm=false --xla_gpu_enable_dynamic_slice_fusion=true"; do
    elapsed "bench.step_profile with $flags"
    XLA_FLAGS="${XLA_FLAGS:-} $flags" timeout 90 "$py" -m bench.step_profile --rows 1 32 --top 5 2>&1 \
      | tee -a "$out/profile_flags.log" | grep -v Warning | tail -14
  done
fi
elapsed "done"
