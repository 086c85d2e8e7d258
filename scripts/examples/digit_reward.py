"""A custom reward in veRL's signature, for the embedded digit task (used by README and the tests).

    python run.py data=files data.train_files=[...] reward=custom \
        reward.path=scripts/examples/digit_reward.py reward.name=compute_score

`ground_truth` is the reversed digits ("4 1 3"); the score is the fraction of digits in place,
divided by the longer of answer and response, so rambling costs credit.
"""

import re


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    target = ground_truth.split()
    items = re.findall(r"\d|[^\d\s]+", solution_str)
    if not target or not items:
        return 0.0
    return sum(w == g for w, g in zip(target, items)) / max(len(target), len(items))
