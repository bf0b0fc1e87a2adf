#!/usr/bin/env bash
# `make setup-slurm`: Slurm's daemons and client tools and MUNGE from Debian/Ubuntu's main archive
# (slurm-wlm 22.05 on Debian 12), for the slurm test tier (`make test-slurm`).
#
# Idempotent. Installs only: it starts no daemon and writes no slurm.conf; the tier's fixture
# (tests/slurm/cluster.py) runs munged, slurmctld and two slurmd in a private directory of its own.
# Where it cannot install (not root, not an apt system), it says why in one line and exits 1.
set -euo pipefail

say() { echo "setup-slurm: $*"; }
tools=(munged slurmctld slurmd sbatch srun scontrol squeue scancel)

missing() {
    local t out=()
    for t in "${tools[@]}"; do command -v "$t" >/dev/null 2>&1 || out+=("$t"); done
    echo "${out[*]}"
}

if [ -z "$(missing)" ]; then
    say "ok: $(slurmd -V 2>/dev/null), $(munged -V 2>/dev/null | head -n1)"
    exit 0
fi
# shellcheck source=scripts/apt_common.sh
. "$(dirname "$0")/apt_common.sh"
require_apt_root setup-slurm "install slurmctld, slurmd, the Slurm client and munge ($(missing) missing) with your package manager"
apt_install slurmctld slurmd slurm-client munge
left=$(missing)
[ -z "$left" ] || { say "error: installed, but still not on PATH: $left"; exit 1; }
say "ok: $(slurmd -V), $(munged -V 2>/dev/null | head -n1)"
