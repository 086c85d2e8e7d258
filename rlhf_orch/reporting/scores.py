"""The one number a run is judged by when it evaluated: the mean of its eval/<source>/mean@k."""

from __future__ import annotations

import re
from typing import Any, Mapping, Optional

from rlhf_orch.logging.base import finite_or_none

# eval/<source>/mean@k: the mean score of k samples per held-out prompt (rlhf_orch.orchestration.evaluation).
EVAL_MEAN = re.compile(r"^eval/(?P<source>.+)/mean@(?P<k>\d+)$")


def eval_score(evaluation: Optional[Mapping[str, Any]]) -> Optional[tuple[float, str]]:
    """(score, what it is) of one evaluation record (summary.json's `eval_last`, or a metrics row):
    the mean of its `eval/<source>/mean@k` values; None when it has none."""
    if not evaluation:
        return None
    found = {k: finite_or_none(v) for k, v in evaluation.items() if EVAL_MEAN.match(str(k))}
    values = {k: v for k, v in found.items() if v is not None}
    if not values:
        return None
    name = next(iter(values)) if len(values) == 1 else f"mean of {len(values)} eval/<source>/mean@k"
    return sum(values.values()) / len(values), name
