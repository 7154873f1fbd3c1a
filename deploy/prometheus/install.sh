#!/usr/bin/env bash
# Install a Prometheus binary from the Debian package into the repository's cache, without
# root and without touching the system: `apt-get download` fetches the .deb, `dpkg-deb -x`
# unpacks it. Prints the binary's path. Idempotent. tests/test_prometheus_dashboard.py uses
# the binary it finds here (or on PATH, or in $LOOPSERVE_PROMETHEUS) and skips without one.
set -euo pipefail
cd "$(dirname "$0")/../.."
target=".cache/prometheus"
binary="$target/usr/bin/prometheus"
if [ ! -x "$binary" ]; then
  mkdir -p "$target/deb"
  (cd "$target/deb" && apt-get download prometheus >/dev/null 2>&1)
  dpkg-deb -x "$target"/deb/prometheus_*.deb "$target"
fi
"$binary" --version >/dev/null
echo "$binary"
