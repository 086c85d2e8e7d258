"""scripts/bench/bench_gpu.py's CPU side: what it plans for each case, and a clean refusal without CUDA."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts" / "bench"))

from bench_gpu import MemoryCase, memory_cases  # noqa: E402


def test_each_case_is_planned_by_the_trainers_own_terms_on_a_gpu():
    case = MemoryCase("Qwen/Qwen2.5-0.5B-Instruct", 0, 4, 1024)
    plan = case.planned()
    params = 494_032_768  # the shape's parameters (tied embeddings), as DeepSpeed counted them on the GPU
    # bf16 weights and gradients, fp32 gradients, fp32 master weights, two fp32 Adam moments
    assert plan["always"] == params * (2 + 2 + 4 + 4 + 8)
    assert plan["terms"]["logits"] == 4 * 1024 * 151936 * 2 * 2  # the logits and their gradient (vocab_reductions)
    assert plan["runtime"] == int(1.39e9)  # the measured GPU runtime, not the CPU one
    zero3 = MemoryCase("Qwen/Qwen2.5-0.5B-Instruct", 3, 4, 1024).planned()
    assert zero3["runtime"] == int(1.39e9) + int(0.41e9) and zero3["terms"]["gathered weights"] == params * 2
    # a ZeRO-2 case is planned at ZeRO-2, the stage it gives DeepSpeed (a run would take one rank's as stage 0)
    zero2 = MemoryCase("Qwen/Qwen2.5-0.5B-Instruct", 2, 4, 1024).planned()
    assert zero2["terms"]["gradient partition"] == params * 2, zero2["terms"]  # (ZeRO-2's own term)
    assert len({c.label for c in memory_cases(quick=False)}) == len(memory_cases(quick=False))


def test_without_cuda_it_says_so_and_exits_2():
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is visible: the bench measures instead")
    # scripts/bench_memory.py: the entry point at the path docs and issues name (it runs scripts/bench/bench_memory.py).
    for script in ("bench/bench_gpu.py", "bench_memory.py --gpu"):
        done = subprocess.run(
            [sys.executable, *f"scripts/{script}".split()], cwd=ROOT, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 2, done.stderr
        assert done.stderr.strip().splitlines() == ["bench_gpu: no CUDA GPU visible to torch; nothing measured"]
