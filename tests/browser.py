"""Headless Chromium for the picture tests: load a page offline, read its DOM and console, take a screenshot and
measure it.

Rules: Chromium runs headless with every network request sent to a dead proxy (127.0.0.1:9), so a page that
needed the network would fail visibly; a fresh profile per call. Console output is read from Chromium's log
(`--enable-logging=stderr`): kvmap's pages log nothing, so any CONSOLE line is a failure. A screenshot is measured
by Chromium itself (no image library): a checking page draws the PNG on a canvas and writes, per box, the
variance of its pixels' grey levels into its DOM.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

TIMEOUT_S = 90


def chromium() -> str | None:
    """The Chromium to use: $KVMAP_CHROMIUM, else chromium or chromium-browser on PATH."""
    return os.environ.get("KVMAP_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


def _run(args: list[str], profile: str) -> subprocess.CompletedProcess:
    exe = chromium()
    assert exe, "no chromium"
    flags = ["--headless", "--disable-gpu", "--no-first-run", "--no-default-browser-check", "--hide-scrollbars",
             f"--user-data-dir={profile}", "--proxy-server=127.0.0.1:9", "--proxy-bypass-list=<-loopback>",
             "--enable-logging=stderr", "--v=0", "--force-device-scale-factor=1"]
    if os.geteuid() == 0:
        flags.append("--no-sandbox")  # Chromium refuses to run as root with its sandbox
    return subprocess.run([exe, *flags, *args], capture_output=True, text=True, timeout=TIMEOUT_S)


def console_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if ":CONSOLE" in line or "Uncaught" in line]


def load(page: Path, width: int = 1200, height: int = 900) -> tuple[str, list[str]]:
    """(the DOM after the page's scripts ran, its console lines)."""
    with tempfile.TemporaryDirectory() as profile:
        p = _run([f"--window-size={width},{height}", "--dump-dom", page.resolve().as_uri()], profile)
    return p.stdout, console_lines(p.stderr)


def screenshot(page: Path, png: Path, width: int = 1200, height: int = 3000) -> list[str]:
    """Write `png`; the console lines."""
    with tempfile.TemporaryDirectory() as profile:
        p = _run([f"--window-size={width},{height}", f"--screenshot={png.resolve()}", page.resolve().as_uri()],
                 profile)
    assert png.exists(), p.stderr[-2000:]
    return console_lines(p.stderr)


_CHECK = """<!doctype html><html><body><canvas id=c></canvas><script>
const boxes = %s;
const img = new Image();
img.onload = () => {
  const c = document.getElementById('c'); c.width = img.width; c.height = img.height;
  const ctx = c.getContext('2d'); ctx.drawImage(img, 0, 0);
  const out = boxes.map(([x, y, w, h]) => {
    w = Math.min(w, img.width - x); h = Math.min(h, img.height - y);
    if (w <= 0 || h <= 0) return -1;
    const d = ctx.getImageData(x, y, w, h).data;
    let s = 0, s2 = 0, n = d.length / 4;
    for (let i = 0; i < d.length; i += 4) { const g = (d[i] + d[i + 1] + d[i + 2]) / 3; s += g; s2 += g * g; }
    return s2 / n - (s / n) ** 2;
  });
  document.body.dataset.variance = JSON.stringify(out);
};
img.src = %s;
</script></body></html>"""


def variances(png: Path, boxes: list[list[int]]) -> list[float]:
    """The grey-level variance of `png` inside each box [x, y, width, height] (-1: outside the image)."""
    with tempfile.TemporaryDirectory() as tmp:
        page = Path(tmp) / "check.html"
        page.write_text(_CHECK % (json.dumps(boxes), json.dumps(png.resolve().as_uri())))
        with tempfile.TemporaryDirectory() as profile:
            p = _run(["--allow-file-access-from-files", "--dump-dom", page.as_uri()], profile)
    m = re.search(r'data-variance="([^"]*)"', p.stdout)
    assert m, p.stderr[-2000:]
    return json.loads(m.group(1).replace("&quot;", '"'))


def figures(dom: str) -> dict[str, dict]:
    """{figure id: its data-* attributes} of every <figure> in a dumped DOM."""
    out = {}
    for tag in re.findall(r"<figure\b[^>]*>", dom):
        attrs = dict(re.findall(r'data-([\w-]+)="([^"]*)"', tag))
        out[attrs.get("fig", str(len(out)))] = attrs
    return out
