"""The embedded digit task written out as files in the two layouts users of other systems have.

`export_digit_task(out_dir)` writes `verl/{train,test}.parquet` (veRL's layout: `data_source`,
`prompt` as chat messages, `ability`, `reward_model.ground_truth`, `extra_info`) and
`openrlhf/{train,test}.jsonl` (an input key and a label key). They train the tiny model with
`data=files` exactly as `data=default` does (`scripts/tools/make_digit_data.py`, the tests, README).
"""

from __future__ import annotations

import json
from pathlib import Path

from rlhf_orch.data.base import DEFAULT_DATA_SEED
from rlhf_orch.data.digit_task import DigitReverseTask


def _task(seed: int) -> DigitReverseTask:
    return DigitReverseTask(
        prompt_max_len=32, response_max_len=16, seed=seed, min_digits=3, max_digits=5, filler_tokens=0
    )


def export_digit_task(
    out_dir: str | Path, train: int = 1024, test: int = 64, seed: int = DEFAULT_DATA_SEED
) -> dict[str, dict[str, str]]:
    """Write both layouts; returns {layout: {split: path}}."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    task = _task(seed)
    splits = {
        "train": task.batch(train, 1),
        "test": task.eval_prompts()[:test] if test <= task.eval_size else _task(seed + 1).batch(test, 0),
    }
    out = Path(out_dir)
    paths: dict[str, dict[str, str]] = {"verl": {}, "openrlhf": {}}
    for split, prompts in splits.items():
        verl_rows = [
            {
                "data_source": p.source,
                "prompt": [{"role": "user", "content": p.text}],
                "ability": "digits",
                "reward_model": {"style": "rule", "ground_truth": p.label},
                "extra_info": {"split": split, "index": i},
            }
            for i, p in enumerate(prompts)
        ]
        (out / "verl").mkdir(parents=True, exist_ok=True)
        path = out / "verl" / f"{split}.parquet"
        pq.write_table(pa.Table.from_pylist(verl_rows), path)
        paths["verl"][split] = str(path)
        (out / "openrlhf").mkdir(parents=True, exist_ok=True)
        path = out / "openrlhf" / f"{split}.jsonl"
        path.write_text("".join(json.dumps({"input": p.text, "label": p.label}) + "\n" for p in prompts))
        paths["openrlhf"][split] = str(path)
    return paths
