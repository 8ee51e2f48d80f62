#!/usr/bin/env bash
# Puts Debian's Prometheus server and promtool (package `prometheus`) under .cache/prometheus/
# without installing the package system-wide (no root, no service started): the tests check
# configs/monitoring/ with them. Prints the directory that holds the two binaries.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=.cache/prometheus
if [ ! -x "$dest/usr/bin/promtool" ] || [ ! -x "$dest/usr/bin/prometheus" ]; then
  tmp=$(mktemp -d) && chmod 777 "$tmp"  # apt downloads as its own user
  trap 'rm -rf "$tmp"' EXIT
  (cd "$tmp" && apt-get download -q prometheus >/dev/null)
  mkdir -p "$dest"
  dpkg-deb -x "$tmp"/prometheus_*.deb "$dest"
fi
"$dest/usr/bin/promtool" --version >/dev/null
echo "$PWD/$dest/usr/bin"
