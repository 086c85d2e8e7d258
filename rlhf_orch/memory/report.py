"""The memory plan as people read it: a table per process (each term), one line per device (need,
capacity, headroom), the derived batch quantities, and for a plan that does not fit its largest
terms and the fixes."""

from __future__ import annotations

from rlhf_orch.memory.fixes import Fix
from rlhf_orch.memory.plan import GB, MemoryPlan
from rlhf_orch.memory.terms import ProcessMemory
from rlhf_orch.topology.plan import text_table
from rlhf_orch.trainer.deepspeed_config import zero_stage_to_run

# Table columns: the terms of `rlhf_orch.memory.terms` grouped the way people speak of them.
COLUMNS: dict[str, tuple[str, ...]] = {
    "weights": ("weights", "teacher weights", "gathered weights"),
    "grads": ("gradients", "gradient partition", "fp32 gradients"),
    "optimizer": ("master weights", "optimizer"),
    "activations": ("activations", "backward workspace", "logits", "entropy", "old log-probs", "forward activations"),
    "kv cache": ("kv cache",),
    "other": (
        "workspace",
        "cuda graphs",
        "lora slots",
        "cpu weight packing",
        "sync buffers",
        "sync send buffers",
        "nccl buffers",
        "allocator reserve",
        "tokenizer",
        "checkpoint load",
        "teacher checkpoint load",
        "zero-3 runtime",
        "runtime",
        "shared libraries",
    ),
}


def _gb(nbytes: float) -> str:
    return f"{nbytes / GB:.2f}"


def _row(proc: ProcessMemory, devices: str) -> list[str]:
    cells = [proc.role, str(proc.rank), devices]
    for names in COLUMNS.values():
        amount = sum(t.bytes for t in proc.terms if t.name in names and not t.on_host)
        cells.append(_gb(amount) if amount else "-")
    cells.append(_gb(proc.peak()))
    host = proc.peak(on_host=True)
    cells.append(_gb(host) if host else "-")
    return cells


def zero_stages_run(plan: MemoryPlan) -> str:
    """trainer.zero_stage as the plan shows it: "ZeRO-2", and the trained roles of one rank that run
    it as stage 0 (`zero_stage_to_run`)."""
    wl = plan.workload
    ranks: dict[str, int] = {}
    for p in plan.processes:
        if p.role in ("actor", "critic"):
            ranks[p.role] = ranks.get(p.role, 0) + 1
    lowered = [role for role, n in ranks.items() if zero_stage_to_run(wl.zero_stage, n, wl.offload_optimizer) == 0]
    if not lowered or wl.zero_stage == 0:
        return f"ZeRO-{wl.zero_stage}"
    return f"ZeRO-{wl.zero_stage} (stage 0 for {', '.join(lowered)}: one rank{' each' if len(lowered) > 1 else ''})"


def describe(plan: MemoryPlan) -> str:
    wl = plan.workload
    where = "GPU" if wl.on_gpu else "host (CPU)"
    lines = [
        f"memory plan (GB = 1e9 bytes; {where}; model shape from {plan.model}: {plan.shape.policy_params / 1e9:.2f}B "
        f"parameters, {plan.shape.layers} layers, hidden {plan.shape.hidden}, vocab {plan.shape.vocab}; dtype {wl.dtype}, "
        f"{zero_stages_run(plan)}{', optimizer offload' if wl.offload_optimizer and wl.on_gpu else ''}"
        f"{', gradient checkpointing' if wl.gradient_checkpointing else ''})",
        "",
    ]
    placed = {id(p): [] for p in plan.processes}
    for load in plan.loads:
        for proc in load.processes:
            placed.setdefault(id(proc), []).append(load.device.name)
    rows = [["role", "rank", "device", *COLUMNS, "total", "host"]]
    for load in plan.loads:
        for proc in load.processes:
            if proc.role == "driver":
                rows.append(_row(proc, load.device.name))
    for proc in plan.processes:
        devices = placed.get(id(proc), [])
        rows.append(_row(proc, devices[0] + (f" +{len(devices) - 1}" if len(devices) > 1 else "")))
    lines += text_table(rows, right_from=3)
    lines.append("")
    device_rows = [["device", "need", "capacity", "margin", "headroom", "", "capacity from"]]
    for load in plan.loads:
        device_rows.append(
            [
                load.device.name,
                _gb(load.need),
                _gb(load.device.capacity),
                _gb(load.device.margin),
                _gb(load.headroom),
                "ok" if load.fits else "DOES NOT FIT",
                load.device.capacity_source,
            ]
        )
    lines += text_table(device_rows, right_from=3)
    if not wl.on_gpu:
        lines.append(
            "total = each process's resident peak; need = the host's used memory: the shared libraries and checkpoint "
            "pages in each total are page cache shared between processes, counted once in need"
        )
    if wl.on_gpu:
        lines.append(
            "need = the worse of generation (engines awake) and training (activations; sleeping engines "
            "freed unless the pipeline generates during training); 'host' = held in host memory (offloaded "
            "states, a sleeping engine's weights)"
        )
    lines.append(worst_case(plan))
    notes = sorted({p.note for p in plan.processes if p.note and p.role == "engine"})
    lines += [f"engine: {note}" for note in notes]
    lines.append("")
    lines.append("batch: " + "  ".join(f"{k}={v}" for k, v in plan.batch.items()))
    return "\n".join(lines)


#: Terms that grow with the tokens of a micro-batch, the table's activations column (the rest are held from the start).
TOKEN_TERMS = COLUMNS["activations"]


def worst_case(plan: MemoryPlan) -> str:
    """Which term makes the worst device's need, and how likely a step is to reach it: held from the
    start (certain), or sized by the largest micro-batch -- which a token bound is reached by as soon
    as the sequences are long enough on average, and a count of sequences only when every one of
    them is at its limit. The device's largest token-sized term follows when another term leads."""
    worst = plan.worst()
    phase = worst.peak_phase()
    on_device = [(f"{p.role}{p.rank} {t.name}", t) for p in worst.processes for t in p.terms if not t.on_host]
    name, term = max(((n, t) for n, t in on_device if t.phase in ("always", phase)), key=lambda item: item[1].bytes)
    where = f"worst case: {worst.device.name}" + ("" if phase == "always" else f" in the {phase} phase")
    sized = [(n, t) for n, t in on_device if t.name in TOKEN_TERMS]
    if term.name in TOKEN_TERMS:
        return f"{where}, largest term {name} {_gb(term.bytes)} GB, {_how_likely(plan)}"
    line = f"{where}, largest term {name} {_gb(term.bytes)} GB: held from the start (certain)"
    if sized:
        name, term = max(sized, key=lambda item: item[1].bytes)
        line += f"; its largest term sized by tokens, {name} {_gb(term.bytes)} GB ({term.phase}), {_how_likely(plan)}"
    return line


def _how_likely(plan: MemoryPlan) -> str:
    wl = plan.workload
    sized = f"sized by {wl.tokens_per_micro_batch} tokens per micro-batch"
    if wl.token_bound:
        per_step = max(wl.sequences_per_rank_step, 1)
        average = -(-wl.token_bound // per_step)
        if average > wl.max_seq_len:
            return (
                f"{sized}: never full (a rank's {per_step} sequences of an optimizer step hold at most "
                f"{per_step * wl.max_seq_len} tokens)"
            )
        return (
            f"{sized}: likely (packed micro-batches of up to {wl.token_bound} tokens fill once a rank's "
            f"{per_step} sequences of an optimizer step average {average} of their {wl.max_seq_len} tokens)"
        )
    return (
        f"{sized}: only when all {wl.micro_batch_size} sequences of a micro-batch are {wl.max_seq_len} tokens long "
        "(prompt and response at their limits; transfer.token_budget bounds it in tokens)"
    )


def refusal(plan: MemoryPlan, fixes: list[Fix], chain: list[Fix] = ()) -> str:
    """Why the plan does not fit (largest terms of the worst device) and the fixes, cheapest first."""
    worst = plan.worst()
    lines = []
    if not worst.fits:
        terms = ", ".join(f"{name} {_gb(nbytes)}" for name, nbytes in worst.largest_terms())
        lines.append(
            f"memory: {worst.device.name} needs {_gb(worst.need)} GB of {_gb(worst.device.capacity)} GB "
            f"({worst.device.capacity_source}; {_gb(worst.device.margin)} GB kept free: launcher.memory_margin); "
            f"largest terms (GB): {terms}"
        )
    lines += [f"memory: {problem}" for problem in plan.engine_problems]
    if fixes:
        lines.append("fixes, cheapest first (each one override to paste):")
        lines += [f"  {fix.describe()}" for fix in fixes]
    else:
        lines.append("no override makes it fit: a device with more memory, or a smaller model")
    if chain:
        last = chain[-1].plan
        # Later fixes of the same key (a micro-batch halved twice) replace earlier ones: Hydra takes one value per key.
        merged = {item.split("=")[0]: item for fix in chain for item in fix.override.split()}
        together = " ".join(merged.values())
        if last.fits:
            verdict = "fits"
        elif last.worst().headroom < 0:
            verdict = (
                f"still short by {-last.worst().headroom / GB:.1f} GB: a device with more memory, or a smaller model"
            )
        else:
            verdict = f"still refused: {'; '.join(last.engine_problems)}"
        lines.append(f"no single override fits; together: {together}   # {verdict}")
    return "\n".join(lines)
