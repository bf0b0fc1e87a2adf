# Sourced by the `make setup-*` scripts: one place that decides whether this machine can install
# Debian/Ubuntu packages. Expects `say` (the script's one-line reporter) to be defined.

# require_apt_root TARGET ELSEWHERE: return when this is a Debian/Ubuntu apt system and we are
# root; otherwise say why in one line (TARGET: the make target; ELSEWHERE: how to install it
# without apt) and exit 1.
require_apt_root() {
    local target=$1 elsewhere=$2
    if [ "$(id -u)" != 0 ]; then
        say "n/a: installing packages needs root; run it as root (sudo make $target), or $elsewhere"
        exit 1
    fi
    if ! command -v apt-get >/dev/null || [ ! -r /etc/os-release ] ||
        ! grep -qiE '^(ID|ID_LIKE)=.*(debian|ubuntu)' /etc/os-release; then
        say "n/a: not a Debian/Ubuntu apt system; $elsewhere"
        exit 1
    fi
}
