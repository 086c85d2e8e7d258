"""rlhf_orch entry point: `python run.py [group=option ...] [key=value ...]`, `-m` for sweeps.

Hydra composes conf/config.yaml with the overrides; rlhf_orch.app checks the result, plans the
Ray topology, and trains. `--cfg job` prints the composed config; `launcher.dry_run=true` prints
the placement plan without starting anything. In a multirun the function returns the run's score
(the objective a sweeper such as Optuna maximises).
"""

from typing import Optional

import hydra
from omegaconf import DictConfig

from rlhf_orch.config.schema import register_configs

register_configs()


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> Optional[float]:
    from rlhf_orch.app import main as app_main
    from rlhf_orch.reporting.objective import job_result

    # A single run exits with the app's code; a multirun job returns its score (None when it did not
    # complete) and never ends the sweep on a failure (rlhf_orch/reporting/objective.py, docs/sweeps.md).
    return job_result(lambda: app_main(cfg))


if __name__ == "__main__":
    from rlhf_orch.config.hydra_errors import hydra_errors_in_one_line

    # An unknown key or option, a malformed override: one line with the closest names, exit 2.
    with hydra_errors_in_one_line():
        main()
