#!/usr/bin/env bash
# `make setup-nsys`: NVIDIA Nsight Systems from Debian's non-free component (2022.4 on Debian 12).
#
# Idempotent. Debian splits the CLI (nsight-systems-target: target-linux-x64/nsys) from its
# importer (nsight-systems: host-linux-x64/QdstrmImporter); without a `host-linux-x64` link
# beside `target-linux-x64`, `nsys profile` writes only a .qdstrm ("importer binary ... not
# found"). This script installs both and makes that link. Where it cannot (not root, not a
# Debian/Ubuntu apt system), it says why in one line and exits 1.
set -euo pipefail

say() { echo "setup-nsys: $*"; }

importer_linked() {
    local nsys target
    nsys=$(command -v nsys 2>/dev/null) || return 1
    target=$(dirname "$(readlink -f "$nsys")")
    [ -x "$target/../host-linux-x64/QdstrmImporter" ]
}

if importer_linked; then
    say "ok: $(nsys --version 2>/dev/null | head -n1) at $(command -v nsys), importer in place"
    exit 0
fi
# shellcheck source=scripts/apt_common.sh
. "$(dirname "$0")/apt_common.sh"
require_apt_root setup-nsys "install Nsight Systems from NVIDIA's installer (see README: Nsight Systems)"

# Debian: the package lives in non-free (its dependencies in contrib). Add both components to
# the existing sources, deb822 (.sources) or one-line (.list), without naming any mirror.
if grep -qi '^ID=debian' /etc/os-release; then
    for f in /etc/apt/sources.list.d/*.sources; do
        [ -e "$f" ] || continue
        sed -i -E '/^Components:/{/non-free([^-]|$)/!s/$/ contrib non-free/}' "$f"
    done
    if [ -f /etc/apt/sources.list ]; then
        sed -i -E '/^deb /{/ non-free( |$)/!s/$/ contrib non-free/}' /etc/apt/sources.list
    fi
fi
apt_install nsight-systems nsight-systems-target

# The importer link: target-linux-x64 (the CLI's folder) needs host-linux-x64 beside it.
nsys_bin=$(readlink -f "$(command -v nsys)")
target_dir=$(dirname "$nsys_bin")
host_dir=$(dpkg -L nsight-systems | grep -m1 '/host-linux-x64$' || true)
if [ -z "$host_dir" ]; then
    importer=$(dpkg -L nsight-systems | grep -m1 '/QdstrmImporter$' || true)
    [ -n "$importer" ] && host_dir=$(dirname "$importer")
fi
if [ -z "$host_dir" ]; then
    say "error: the nsight-systems package has no host-linux-x64/QdstrmImporter (dpkg -L nsight-systems); cannot link the importer"
    exit 1
fi
link="$(dirname "$target_dir")/host-linux-x64"
if [ -L "$link" ] && [ ! -e "$link" ]; then
    rm -f "$link"  # left dangling by a purge of the packages (dpkg does not own it)
fi
if [ ! -e "$link" ]; then
    ln -s "$host_dir" "$link"
fi
importer_linked || { say "error: $link does not lead to QdstrmImporter"; exit 1; }
say "ok: $(nsys --version | head -n1) at $(command -v nsys), importer linked at $link"
