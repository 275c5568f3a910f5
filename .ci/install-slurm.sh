#!/bin/sh
# Install what tests/slurm_cluster.py needs to run a throwaway two-node SLURM
# cluster on one machine: slurmctld, slurmd, the client tools (srun, sinfo,
# scontrol, sbatch) and munge. Debian/Ubuntu only.
#
# Idempotent: exits 0 without touching apt when everything is already there.
# Must run as root (or with passwordless sudo available).
set -eu

# Keep in step with _DAEMONS and _CLIENTS in tests/slurm_cluster.py.
needed="munged slurmctld slurmd srun sbatch sinfo squeue scontrol scancel"

have_all() {
    for b in $needed; do
        # The daemons live in /usr/sbin, which is not always on a CI user's PATH.
        command -v "$b" >/dev/null 2>&1 || [ -x "/usr/sbin/$b" ] || return 1
    done
    return 0
}

if have_all; then
    echo "install-slurm: slurm and munge already installed"
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo -n"
fi
# Passed through env(1) because sudo drops most of the environment.
APT="$SUDO env DEBIAN_FRONTEND=noninteractive apt-get"
# slurm-wlm is the metapackage pulling in slurmctld, slurmd, slurm-client and
# the basic plugins. --no-install-recommends keeps it to ~9 packages (no docs,
# no slurm-wlm-doc, no mail server).
PKGS="slurm-wlm munge"

apt_install() {
    $APT install -y -q --no-install-recommends \
        -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold \
        $PKGS
}

# Only refresh the package lists when the packages cannot be found (a fresh
# container has empty lists); otherwise `apt-get update` is a waste of time.
if ! apt-cache show slurm-wlm munge >/dev/null 2>&1; then
    $APT update -q
fi
if ! apt_install; then
    # Stale lists (404 on a superseded .deb): refresh and retry once.
    $APT update -q
    apt_install
fi

if ! have_all; then
    echo "install-slurm: packages installed but some binaries are missing" >&2
    exit 1
fi
echo "install-slurm: done"
