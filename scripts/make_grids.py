"""Compute the Gaussian grids HIGGS uses by default (2-D, 16 / 64 / 256 points, seed 0; about a minute on
2 cores) and write them into the package (``kvcomp/stages/grid_data/``), where :func:`kvcomp.stages.grids.gaussian_grid`
reads them instead of computing them.

    python scripts/make_grids.py
"""

from kvcomp.stages.grids import GRID_SAMPLES, GRID_STEPS, PACKAGED, grid_file_name, grid_mse, lloyd_grid, write_grid

SHIPPED = (16, 64, 256)  # 2, 3 and 4 bits per coordinate pair


def main() -> None:
    for n in SHIPPED:
        meta = {"n": n, "d": 2, "seed": 0, "samples": GRID_SAMPLES, "steps": GRID_STEPS}
        grid = lloyd_grid(n, 2, GRID_SAMPLES, GRID_STEPS, 0)
        write_grid(grid, meta, PACKAGED / grid_file_name(meta))
        print(f"{grid_file_name(meta)}: MSE per coordinate {grid_mse(grid):.6f}")


if __name__ == "__main__":
    main()
