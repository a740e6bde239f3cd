"""Entry point: ``python run.py [group=option ...] [key=value ...]`` (Hydra; ``-m`` sweeps)."""

from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from kvcomp.config import register_configs

register_configs()
CONF = Path(__file__).resolve().parent / "conf"


@hydra.main(config_path=str(CONF), config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from kvcomp.sweep import run_job

    job = HydraConfig.get()
    run_job(cfg, Path(job.runtime.output_dir), list(job.overrides.task), job.mode == RunMode.MULTIRUN, job.launcher)


if __name__ == "__main__":
    from kvcomp.sweep import one_line_errors

    with one_line_errors(CONF):  # bad input, Hydra's composition errors included: one line, exit status 2
        main()
