"""Entry point: ``python run.py [group=option ...] [key=value ...]`` (Hydra; ``-m`` sweeps)."""

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from kvcomp.config import register_configs

register_configs()


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from kvcomp.sweep import run_job

    job = HydraConfig.get()
    run_job(cfg, Path(job.runtime.output_dir), list(job.overrides.task), job.mode == RunMode.MULTIRUN, job.launcher)


if __name__ == "__main__":
    main()
