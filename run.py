"""rlhf_orch entry point: `python run.py [group=option ...] [key=value ...]`, `-m` for sweeps.

Hydra composes conf/config.yaml with the overrides; rlhf_orch.app checks the result, plans the
Ray topology, and trains. `--cfg job` prints the composed config; `launcher.dry_run=true` prints
the placement plan without starting anything.
"""

import sys

import hydra
from omegaconf import DictConfig

from rlhf_orch.config.schema import register_configs

register_configs()


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from rlhf_orch.app import main as app_main

    code = app_main(cfg)
    if code:
        sys.exit(code)


if __name__ == "__main__":
    main()
