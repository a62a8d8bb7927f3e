#!/usr/bin/env bash
# Configures and builds one build tree. Usage: scripts/build.sh DIR [cmake -D options...]
set -euo pipefail
cd "$(dirname "$0")/.."
dir=$1
shift
# The compiler cache: one for every tree and clone (the paths under this checkout are
# rewritten relative to it, and the working directory is not hashed, so that a fresh clone
# elsewhere hits what another built).
export CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/ubep-ccache}"
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$PWD}"
export CCACHE_NOHASHDIR="${CCACHE_NOHASHDIR:-true}"
cmake -S . -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE="${UBEP_BUILD_TYPE:-RelWithDebInfo}" "$@" >/dev/null
cmake --build "$dir" -j "$(nproc)"
