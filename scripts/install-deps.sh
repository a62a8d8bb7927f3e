#!/usr/bin/env bash
# Installs the Debian packages UBEP builds, tests and runs with. Idempotent: packages
# already present are skipped, and apt is not touched at all when nothing is missing.
#
# Usage: scripts/install-deps.sh            (as root, or with sudo available)
set -euo pipefail

packages=(
  build-essential cmake ninja-build ccache pkg-config
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev prometheus-cpp-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  nlohmann-json3-dev
  openmpi-bin libopenmpi-dev
  prometheus
  gnuplot-nox
  python3
)
# Tools the ops tests use, from Debian unless the machine has them already: kubectl (for
# `kubectl kustomize`), Node.js and npm (the manifests' schema check).
command -v kubectl >/dev/null || packages+=(kubernetes-client)
command -v npm >/dev/null || packages+=(nodejs npm)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed'; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#packages[@]} packages present"
  exit 0
fi

sudo=()
if [ "$(id -u)" -ne 0 ]; then
  if ! command -v sudo >/dev/null; then
    echo "install-deps: missing ${missing[*]}; run this as root, or install sudo" >&2
    exit 1
  fi
  # Without a terminal a password prompt cannot be answered: said at once, not after ten
  # minutes of apt-get failing.
  if ! sudo -n true 2>/dev/null && [ ! -t 0 ]; then
    echo "install-deps: missing ${missing[*]}; sudo needs a password and there is no terminal:" \
         "run this as root, or install them first" >&2
    exit 1
  fi
  sudo=(sudo)
fi
echo "install-deps: installing ${missing[*]}"
# sudo drops the environment: apt's settings go on its command line. The lock timeout covers
# a fresh VM's unattended upgrades, which hold apt's lock for a while after boot.
# (LC_ALL=C: the lock's message is matched below, in apt's own words.)
apt=(${sudo[@]+"${sudo[@]}"} env DEBIAN_FRONTEND=noninteractive LC_ALL=C apt-get -o DPkg::Lock::Timeout=600)
# apt-get update takes the lists' lock, which the lock timeout does not cover: tried again
# for up to 10 minutes while another apt holds it.
# Any other failure (a broken source, no network) is said at once.
errors="$(mktemp)"
trap 'rm -f "$errors"' EXIT
for attempt in $(seq 60); do
  if "${apt[@]}" update -qq 2> "$errors"; then break; fi
  cat "$errors" >&2
  if ! grep -q "Could not get lock" "$errors"; then
    echo "install-deps: apt-get update failed (above)" >&2
    exit 1
  fi
  if [ "$attempt" -eq 60 ]; then echo "install-deps: apt-get update kept failing" >&2; exit 1; fi
  echo "install-deps: another apt holds the package lists' lock; again in 10 s" >&2
  sleep 10
done
"${apt[@]}" install -y -qq --no-install-recommends "${missing[@]}"
