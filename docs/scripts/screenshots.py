"""Build the site and take screenshots of three rendered pages with headless Chromium.

    python docs/scripts/screenshots.py            # writes docs/screenshots/{home,tutorial,config}.png

The pages are served over HTTP from a fresh `mkdocs build --strict` (as a reader's browser would load them,
with no network: the theme's fonts are off, everything else is bundled). Look at the PNGs after a change to
the theme, the nav or a page's layout. Chromium is started as tests/test_live_page.py starts it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "docs" / "screenshots"
PAGES = {"home": "", "tutorial": "tutorials/first-job/", "config": "config/"}
WINDOW = "1280,1600"

sys.path.insert(0, str(ROOT / "tests"))
from test_live_page import chromium  # noqa: E402  (the tests' one way of running headless Chromium)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def main() -> int:
    OUT.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        site = tmp / "site"
        env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
        subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=ROOT,
                       env=env, check=True)
        port = free_port()
        server = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"], cwd=site,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            for _ in range(100):
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=1).close()
                    break
                except OSError:
                    time.sleep(0.1)
            for name, path in PAGES.items():
                shot = OUT / f"{name}.png"
                done = chromium(tmp, f"--window-size={WINDOW}", f"--screenshot={shot}",
                                f"http://127.0.0.1:{port}/{path}")
                if done.returncode != 0 or not shot.exists():
                    print(f"{name}: chromium failed\n{done.stderr}", file=sys.stderr)
                    return 1
                print(f"{name}: {shot.relative_to(ROOT)}")
        finally:
            server.terminate()
            server.wait(timeout=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
