#!/usr/bin/env bash
# Fetch Nsight Systems (Debian 12 non-free: nsight-systems 2022.4) and unpack it into a folder, without a
# system install: `scripts/get_nsys.sh [DEST]` (default .tools/nsys), then `DEST/bin/nsys --version`.
#
# - Uses the machine's own Debian mirror (from /etc/apt/sources.list.d/*.sources), adding the non-free
#   component in a private apt configuration; lists and cache live in a temporary folder.
# - Unpacks nsight-systems, nsight-systems-target and libssh-4 (the importer needs it) with dpkg-deb -x.
# - Links host-linux-x64 beside the target folder: this nsys looks for its importer (QdstrmImporter) only
#   there, and without it writes a .qdstrm instead of a .nsys-rep.
# - Works with the `nvtx` Python package 0.2.10-0.2.11 only (newer ones record nothing under nsys 2022.4): it
#   says so at the end; the README's profiling block pins it (`pip install nvtx==0.2.11`).
set -euo pipefail
DEST=$(realpath -m "${1:-.tools/nsys}")
NVTX_NOTE="this nsys records NVTX only from the nvtx package 0.2.10-0.2.11: pip install nvtx==0.2.11"
if [ -x "$DEST/bin/nsys" ] && "$DEST/bin/nsys" --version >/dev/null 2>&1; then
  echo "nsys already in $DEST/bin/nsys; $NVTX_NOTE"; exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lists/partial" "$work/cache/archives/partial" "$work/debs"
src=$(ls /etc/apt/sources.list.d/*.sources 2>/dev/null | grep -v disabled | head -n 1 || true)
if [ -z "$src" ]; then
  echo "get_nsys: no Debian deb822 sources in /etc/apt/sources.list.d; install nsight-systems from NVIDIA" >&2
  exit 1
fi
# every stanza of the machine's Debian sources, with non-free added to its components
sed -E 's/^(Components:.*)$/\1 contrib non-free/' "$src" > "$work/debian.sources"
APT=(-o Dir::Etc::SourceList=/dev/null -o Dir::Etc::SourceParts="$work" -o Dir::State::Lists="$work/lists"
     -o Dir::Cache="$work/cache" -o Debug::NoLocking=1 -o APT::Get::List-Cleanup=0 -o APT::Sandbox::User=root)
apt-get "${APT[@]}" update -qq
(cd "$work/debs" && apt-get "${APT[@]}" download -qq nsight-systems nsight-systems-target libssh-4)
mkdir -p "$DEST/root"
for deb in "$work"/debs/*.deb; do dpkg-deb -x "$deb" "$DEST/root"; done
lib="$DEST/root/usr/lib"
target=$(dirname "$(find "$lib" -type f -name nsys -path '*target-linux-x64*' | head -n 1)")
host=$(find "$lib" -type d -name host-linux-x64 | head -n 1)
[ -n "$target" ] && [ -n "$host" ] || { echo "get_nsys: unexpected package layout" >&2; exit 1; }
ln -sfn "$host" "$(dirname "$target")/host-linux-x64"
mkdir -p "$DEST/bin"
cat > "$DEST/bin/nsys" <<WRAP
#!/usr/bin/env bash
export LD_LIBRARY_PATH="$DEST/root/usr/lib/x86_64-linux-gnu\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
exec "$target/nsys" "\$@"
WRAP
chmod +x "$DEST/bin/nsys"
"$DEST/bin/nsys" --version
echo "$NVTX_NOTE"
