#!/usr/bin/env bash
# Install what the real-Slurm preemption drill needs (Debian packages): a one-node cluster with accounting.
# Needs root and apt-get; elsewhere it says so and the drill is skipped (in CI, where CI=true, it fails instead).
set -euo pipefail
PKGS=(slurmctld slurmd slurm-client slurmdbd munge mariadb-server)
if command -v slurmctld >/dev/null && command -v slurmdbd >/dev/null && command -v mariadbd >/dev/null; then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "[slurm] not root or no apt-get: skipping the install of ${PKGS[*]}" >&2
  exit 0
fi
echo "[slurm] installing ${PKGS[*]}"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${PKGS[@]}" >/dev/null
