"""Entry point: ``python run.py [group=option ...] [key=value ...]`` (Hydra; ``-m`` sweeps)."""

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from kvcomp.config import register_configs
from kvcomp.errors import KVCompError

register_configs()


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from kvcomp.runner import run

    try:
        run(cfg, Path(HydraConfig.get().runtime.output_dir))
    except KVCompError as error:
        print(f"kvcomp error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
