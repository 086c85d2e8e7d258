#!/usr/bin/env bash
# The first thing to run on a machine with GPUs (docs/gpu.md): the gpu-marked tests, then two steps
# of experiment=quick with sync=nccl_bucketed (split) and sync=cuda_ipc (colocated) on the GPUs
# present. Prints a short report to paste into an issue; anything that cannot run here is reported
# as skipped, with the reason. Usage: scripts/gpu_smoke.sh [python]   (default: .venv/bin/python)
set -u
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
[ -x "$PY" ] || PY=python
OUT=${GPU_SMOKE_DIR:-/tmp/rlhf_orch_gpu_smoke}
mkdir -p "$OUT"
REPORT=()
add() { REPORT+=("$1"); }

GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)" 2>/dev/null || echo 0)
add "date: $(date -u +%Y-%m-%dT%H:%MZ)  commit: $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
add "gpus: $GPUS ($(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | sort | uniq -c | tr -s ' ' | paste -sd';' -))"
add "versions: $("$PY" -c "
import importlib
out = []
for m in ('torch', 'vllm', 'transformers', 'deepspeed', 'ray'):
    try:
        out.append(f'{m} {importlib.import_module(m).__version__}')
    except Exception as e:
        out.append(f'{m} MISSING')
print(', '.join(out))" 2>&1 | tail -1)"
VLLM_OK=$("$PY" -c "from rlhf_orch.engines.llm_start import check_vllm_interfaces as c; c(); print('ok')" 2>&1 | tail -1)
add "vllm interfaces: $VLLM_OK"

# 1. gpu-marked tests (they skip themselves where they need more GPUs than present)
if [ "$GPUS" -ge 1 ]; then
  "$PY" -m pytest -q -m gpu tests/sync/test_sync_gpu.py tests/trainer/test_shared_prompts_gpu.py -p no:cacheprovider -rs >"$OUT/gpu_tests.log" 2>&1
  add "gpu tests: rc=$? $(tail -1 "$OUT/gpu_tests.log")  (log: $OUT/gpu_tests.log)"
else
  add "gpu tests: skipped (no CUDA GPU visible to torch)"
fi

run_quick() {  # name, needed GPUs, overrides...
  local name=$1 need=$2; shift 2
  if [ "$GPUS" -lt "$need" ]; then
    add "$name: skipped (needs $need GPUs, $GPUS present)"; return
  fi
  case "$VLLM_OK" in ok) ;; *) add "$name: skipped (vLLM unusable: $VLLM_OK)"; return ;; esac
  local t0=$SECONDS
  "$PY" run.py experiment=quick "$@" hydra.run.dir="$OUT/$name" >"$OUT/$name.log" 2>&1
  local rc=$?
  add "$name: rc=$rc in $((SECONDS - t0)) s; $(tail -1 "$OUT/$name.log" | cut -c1-200)"
}

# 2. split layout, NCCL broadcast: actor, critic and one engine each on a GPU of its own (NCCL refuses
#    two ranks on one GPU, so this needs 3 GPUs)
run_quick split_nccl_bucketed 3 placement=split placement.gpus_per_node="$GPUS" placement.actor_gpus=1 \
  placement.critic_gpus=1 placement.vllm_gpus=1 sync=nccl_bucketed
# 3. colocated layout, CUDA IPC: every role and one engine per GPU, on all GPUs present (1 is enough)
run_quick colocated_cuda_ipc 1 placement=colocated placement.gpus_per_node="$GPUS" sync=cuda_ipc

echo
echo "=== rlhf_orch GPU smoke report (paste into an issue) ==="
printf '%s\n' "${REPORT[@]}"
