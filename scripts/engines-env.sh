#!/usr/bin/env bash
# Create one environment per inference engine from tandem's extras: .venv-vllm and/or .venv-sglang.
#   scripts/engines-env.sh vllm|sglang|all
# vLLM 0.33.0 pins torch 2.14.0 and SGLang 0.5.23 pins torch 2.14.1 (both CUDA 13 builds), so they cannot share
# an environment with each other or with .venv (CPU torch). Each env gets tandem editable, so rollout servers
# (and, for vLLM's NCCL group, the learner) run from it. Needs a Linux x86_64 host with an NVIDIA driver for
# CUDA 13; the packages install elsewhere, but the engines will not start without a GPU.
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"

make_env() {
  local engine="$1" venv=".venv-$1"
  if [ ! -x "$venv/bin/python" ]; then
    echo "[tandem] creating $venv"
    "$PYTHON" -m venv "$venv"
  fi
  echo "[tandem] installing tandem[$engine,dev] into $venv (pulls the engine's CUDA torch; several GB)"
  "$venv/bin/python" -m pip install --disable-pip-version-check -q --upgrade pip
  "$venv/bin/python" -m pip install --disable-pip-version-check -q -e ".[$engine,dev]"
  "$venv/bin/python" - "$engine" <<'PY'
import importlib.metadata as md, sys
engine = sys.argv[1]
print(f"[tandem] {engine} {md.version(engine)}, torch {md.version('torch')}")
PY
  echo "[tandem] contract check against the installed package: $venv/bin/python -m pytest -m engines"
}

case "${1:-}" in
  vllm | sglang) make_env "$1" ;;
  all) make_env vllm; make_env sglang ;;
  *) echo "usage: $0 vllm|sglang|all" >&2; exit 2 ;;
esac
