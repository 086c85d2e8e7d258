"""The published reference an experiment carries (`reference:` in conf/experiment/<name>.yaml).

Structured data, read by code: where the published run comes from, its hardware, and every
published number with the metric of ours that measures it, the step it was taken at, a tolerance
and why. `load_reference` refuses (one line, at load time) a number whose metric no run logs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional

# Metrics a run writes to metrics.jsonl (rlhf_orch/orchestration/loop.py, evaluation.py);
# `eval/<source>/mean@<k>` and `pass@<k>` exist per data source.
LOGGED_METRICS = frozenset(
    {
        "reward/mean",
        "reward/max",
        "reward/solved_frac",
        "reward/model",
        "reward/rule",
        "kl",
        "loss/policy",
        "loss/value",
        "loss/kl",
        "policy/clipfrac",
        "policy/approx_kl",
        "policy/entropy",
        "response/mean_len",
        "response/max_len",
        "perf/tokens_per_s",
        "perf/gen_tokens_per_s",
        "time/step",
        "time/generate",
        "time/transfer",
        "time/experience",
        "time/train",
        "time/sync",
        "share/generate",
        "share/transfer",
        "share/experience",
        "share/train",
        "share/sync",
        "sync/bytes_per_engine",
        "sync/gb_per_s",
        "transfer/wire_bytes",
    }
)
_EVAL_METRIC = re.compile(r"^eval/[^@]+/(mean|pass)@\d+$")


class ReferenceError(ValueError):
    """A reference block that code cannot use (one line naming the experiment and the field)."""


def is_logged_metric(name: str) -> bool:
    return name in LOGGED_METRICS or bool(_EVAL_METRIC.match(name))


@dataclass(frozen=True)
class PublishedNumber:
    name: str
    value: float
    unit: str
    measures: str
    metric: Optional[str]  # None: nothing we log measures it (said in `measures`)
    at_step: Optional[int] = None  # None: the median over the run's steps (after the first)
    tolerance: Optional[float] = None
    tolerance_why: str = ""
    confidence: str = ""
    # "within": |measured - value| <= tolerance; "at_least" / "at_most": a published bound
    # (measured >= value - tolerance / measured <= value + tolerance).
    comparison: str = "within"


@dataclass(frozen=True)
class Reference:
    experiment: str
    title: str
    runnable: bool
    source: dict[str, Any]
    hardware: dict[str, Any]
    numbers: tuple[PublishedNumber, ...]
    notes: tuple[str, ...] = ()
    not_modelled: tuple[Any, ...] = ()
    why_not_runnable: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def gpus(self) -> int:
        return int(self.hardware.get("nodes", 1)) * int(self.hardware.get("gpus_per_node", 0))


def load_reference(experiment: str, block: Any) -> Reference:
    if not block:
        raise ReferenceError(
            f"experiment={experiment}: no `reference:` block; it is not a reproduction of a published run"
        )
    block = dict(block)
    numbers = []
    for i, raw in enumerate(block.get("numbers") or []):
        raw = dict(raw)
        where = f"experiment={experiment}: reference.numbers[{i}] ({raw.get('name', '?')})"
        for key in ("name", "value", "unit", "measures"):
            if raw.get(key) is None:
                raise ReferenceError(f"{where} has no `{key}`")
        metric = raw.get("metric")
        if metric is not None and not is_logged_metric(metric):
            raise ReferenceError(
                f"{where} is measured by metric {metric!r}, which no run logs; use one of "
                f"{', '.join(sorted(LOGGED_METRICS))} or eval/<source>/mean@<k> / pass@<k> (or metric: null)"
            )
        known = {f for f in PublishedNumber.__dataclass_fields__}
        numbers.append(PublishedNumber(**{k: v for k, v in raw.items() if k in known}))
        if numbers[-1].comparison not in ("within", "at_least", "at_most"):
            raise ReferenceError(f"{where}: comparison must be 'within', 'at_least' or 'at_most'")
    main = {"title", "runnable", "source", "hardware", "numbers", "notes", "not_modelled", "why_not_runnable"}
    return Reference(
        experiment=experiment,
        title=str(block.get("title", experiment)),
        runnable=bool(block.get("runnable", True)),
        source=dict(block.get("source") or {}),
        hardware=dict(block.get("hardware") or {}),
        numbers=tuple(numbers),
        notes=tuple(block.get("notes") or ()),
        not_modelled=tuple(block.get("not_modelled") or ()),
        why_not_runnable=str(block.get("why_not_runnable") or ""),
        extra={k: v for k, v in block.items() if k not in main},
    )
