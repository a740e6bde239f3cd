"""A screenshot of a static page in headless Chromium (Debian's ``chromium`` package), to look at what a script
rendered, e.g. the leaderboard.

    python scripts/screenshot_page.py leaderboard/index.html --out leaderboard.png [--width 1300 --height 4000]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
from pathlib import Path

from kvcomp.errors import at_least


def screenshot(page: Path, out: Path, width: int = 1300, height: int = 4000) -> Path:
    """Render ``page`` with headless Chromium into the PNG ``out`` (the browser's stderr on failure)."""
    browser = next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)
    if browser is None:
        raise SystemExit("no Chromium on the PATH: apt-get install chromium")
    command = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
               f"--window-size={width},{height}", f"--screenshot={out.resolve()}", page.resolve().as_uri()]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    if done.returncode or not out.is_file():
        raise SystemExit(f"chromium failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return out


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("page", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--width", type=at_least(100), default=1300)
    parser.add_argument("--height", type=at_least(100), default=4000)
    args = parser.parse_args(argv)
    return screenshot(args.page, args.out, args.width, args.height)


if __name__ == "__main__":
    main()
