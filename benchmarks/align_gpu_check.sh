#!/usr/bin/env bash
# Device check for `h2jax align` on a host with one NVIDIA GPU: the host CPU (`cpu`) and the GPU
# (`cuda`) compared against the float64 host reference, op and layer level on the default model,
# then a short run level. Needs jax with the CUDA plugin (jax-cuda12-plugin); never run on a
# CPU-only machine (it exits 2 there: no `cuda` backend).
#
#   bash benchmarks/align_gpu_check.sh [OUT_DIR]        # ~3-6 minutes on an H100/H200 host
#
# What to expect, and what each step shows:
#   1. cuda with matmul_precision=default: XLA may run fp32 matmuls as TF32 (10 mantissa bits)
#      on Ampere and later, so the dot_general ops (fwd and bwd) should fail the op level with
#      rel L2 ~1e-4..1e-3 and error ratios >> 2 against the host; `--numerics
#      cuda.matmul_input_rounding=tf32` on the `cpu` chip should reproduce the same size.
#   2. cuda with matmul_precision=highest: true fp32; every op should pass or warn (other
#      transcendental/reduction implementations), layer level within 2e-3.
#   3. run level, 100 steps, both policies: the loss MRE of each against the reference.
# Each command prints its tables; the JSON/PNG reports land in OUT_DIR/<step>/. Exit status:
# 0 when step 2 passes every gate (the aligned policy), else 1.
set -u
OUT=${1:-runs/align_gpu_check}
mkdir -p "$OUT"
run() { # name, then the align arguments
  local name=$1
  shift
  local t0=$SECONDS
  python -m h2jax.cli_align "$@" --out "$OUT/$name" >"$OUT/$name.log" 2>&1
  local code=$?
  echo "== $name: exit $code, $((SECONDS - t0)) s (log $OUT/$name.log)"
  tail -n 40 "$OUT/$name.log"
  return $code
}
python -c "import jax; print(jax.__version__, jax.devices('cuda'))" || exit 2
run tf32_default --chips cpu cuda --levels op layer --numerics cuda.matmul_precision=default
run emulated_tf32 --chips cpu cuda --levels op --numerics cpu.matmul_input_rounding=tf32 cuda.matmul_precision=default
run fp32_highest --chips cpu cuda --levels op layer --numerics cuda.matmul_precision=highest
aligned=$?
run run_default --chips cpu cuda --levels run --steps 100 --no-plan --numerics cuda.matmul_precision=default
run run_highest --chips cpu cuda --levels run --steps 100 --no-plan --numerics cuda.matmul_precision=highest
exit $aligned
