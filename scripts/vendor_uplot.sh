#!/usr/bin/env bash
# Refresh the vendored uPlot (kvmap/render/html/vendor/) from npm's tarball of the pinned release, unchanged.
# Usage: scripts/vendor_uplot.sh [VERSION]   (default: the version kvmap/render/html/page.py pins; then update
# UPLOT_VERSION there and the checksum in tests/test_pictures.py)
set -euo pipefail
cd "$(dirname "$0")/.."
version="${1:-$(sed -n 's/^UPLOT_VERSION = "\([0-9.]*\)".*/\1/p' kvmap/render/html/page.py)}"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm pack "uplot@$version" --silent >/dev/null && tar xzf "uplot-$version.tgz")
cp "$tmp/package/dist/uPlot.iife.min.js" "$tmp/package/dist/uPlot.min.css" kvmap/render/html/vendor/
cp "$tmp/package/LICENSE" kvmap/render/html/vendor/LICENSE.uPlot
sha256sum kvmap/render/html/vendor/uPlot.iife.min.js
