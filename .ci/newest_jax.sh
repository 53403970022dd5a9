#!/usr/bin/env bash
# CI's second lane: h2jax on the newest releases of its supported range (jax 0.12.x needs
# Python >= 3.12), in a fresh virtual environment of Python 3.12 (or 3.13), beside the first
# lane's Python 3.11 / jax 0.10 (`python3`). It installs with the test extra (which builds the
# FFI extension against that jax's headers), then runs the fast lane, the mpirun tests, and
# the default job for a few steps, whose losses must equal the first lane's within 1e-5, and
# `h2jax align` of the tiny model against its default gates.
#
#   bash .ci/newest_jax.sh            # H2JAX_CI_PYTHON=/path/to/python3.12 picks the interpreter
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${H2JAX_CI_PYTHON:-}
if [ -z "$PY" ]; then  # pyenv's versions first (its shims on PATH fail for a version not selected)
  for cand in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12.*/bin/python3.12 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.13.*/bin/python3.13 \
    "$(command -v python3.12 || true)" "$(command -v python3.13 || true)"; do
    if [ -n "$cand" ] && "$cand" -c 'import venv' >/dev/null 2>&1; then
      PY=$cand
      break
    fi
  done
fi
if [ -z "$PY" ]; then
  echo "newest_jax: no Python 3.12 or 3.13 here (set H2JAX_CI_PYTHON); the second lane cannot run" >&2
  exit 2
fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
echo "== second lane: $("$PY" --version) in $WORK/venv"
"$PY" -m venv "$WORK/venv"
VPY=$WORK/venv/bin/python
"$VPY" -m pip install -q --upgrade pip
"$VPY" -m pip install -q -e '.[test]'
# the newest in range, or this lane tests nothing the first does not
"$VPY" - <<'PY'
import importlib.metadata as md
import sys

got = {n: md.version(n) for n in ("jax", "jaxlib", "flax", "orbax-checkpoint", "optax")}
print("second lane:", sys.version.split()[0], ", ".join(f"{n} {v}" for n, v in got.items()))
if tuple(int(x) for x in got["jax"].split(".")[:2]) < (0, 11):
    sys.exit(f"newest_jax: pip resolved jax {got['jax']}, not the newest of h2jax's range")
PY
export PATH="$WORK/venv/bin:$PATH"  # its h2jax and mpirun first, for the tests' subprocesses
"$VPY" -m pytest -q -m "not slow and not multiproc"
"$VPY" -m pytest -q -m multiproc
# the default job, deterministic: the same losses on both lanes (one corpus file for both: the
# built-in corpus is the running Python's own pydoc text, which differs between releases)
python3 -c "from h2jax.data import default_corpus_text; print(default_corpus_text(), end='')" >"$WORK/corpus.txt"
for lane in first second; do
  py=python3
  [ "$lane" = second ] && py=$VPY
  "$py" -m h2jax.cli train train.steps=5 "data.corpus=$WORK/corpus.txt" train.progress=false \
    --run-dir "$WORK/train_$lane" >"$WORK/train_$lane.log" 2>&1 || { tail -n 20 "$WORK/train_$lane.log"; exit 1; }
done
"$VPY" .ci/same_losses.py "$WORK/train_first/metrics.jsonl" "$WORK/train_second/metrics.jsonl"
# every chip type computes the same model on this jax too: align's default gates, on the tiny model
"$VPY" -m h2jax.cli align configs/tiny.yaml --out "$WORK/align" >"$WORK/align.log" 2>&1 || { tail -n 30 "$WORK/align.log"; exit 1; }
tail -n 3 "$WORK/align.log"
