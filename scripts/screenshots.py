"""The README's two pictures: the replay report of the long bundled trace and the explain page of the worked
example (the explainer's own step), as PNG screenshots by headless Chromium.

Usage: python scripts/screenshots.py [OUT_DIR]   (default docs/; needs chromium on PATH or $KVMAP_CHROMIUM)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHOTS = {  # file: (kvmap arguments writing the page to PAGE, window width, height)
    "report.png": (["replay", "long_mixed", "--no-progress", "-q", "--html", "PAGE"], 1000, 1250),
    "explain.png": (["explain", "worked_example", "--step", "1", "--req", "B", "--token", "0", "--html", "PAGE"],
                    1000, 1100),
}


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "docs"
    exe = os.environ.get("KVMAP_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        sys.exit("screenshots: no chromium on PATH (apt-get install chromium), or set KVMAP_CHROMIUM")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (args, width, height) in SHOTS.items():
            page = Path(tmp) / (name + ".html")
            subprocess.run([sys.executable, "-m", "kvmap", *[str(page) if a == "PAGE" else a for a in args]],
                           check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
            flags = ["--headless", "--disable-gpu", "--hide-scrollbars", "--proxy-server=127.0.0.1:9",
                     f"--user-data-dir={tmp}/profile", f"--window-size={width},{height}",
                     "--force-device-scale-factor=1", f"--screenshot={out / name}"]
            if os.geteuid() == 0:
                flags.append("--no-sandbox")
            subprocess.run([exe, *flags, page.as_uri()], check=True, capture_output=True)
            print(f"wrote {out / name} ({(out / name).stat().st_size // 1024} KiB)")


if __name__ == "__main__":
    main()
