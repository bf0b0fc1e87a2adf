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

# apt_install PKG...: apt-get update, then install PKG..., waiting up to 10 minutes for another apt
# or dpkg (an unattended upgrade, a second setup beside this one) to let go of its lock instead of
# failing on it. apt 2.6's `update` ignores DPkg::Lock::Timeout for its lists lock: it is retried
# while the error is the lock, 10 s apart; any other error fails at once.
apt_install() {
    export DEBIAN_FRONTEND=noninteractive
    local i err
    for i in $(seq 60); do
        if err=$(apt-get update -qq 2>&1); then
            [ -z "$err" ] || echo "$err" >&2
            apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "$@" >/dev/null
            return
        fi
        case $err in
            *"Unable to lock"* | *"Could not get lock"*)
                [ "$i" -gt 1 ] || say "waiting for another apt to let go of its lock (up to 10 minutes)"
                sleep 10 ;;
            *) echo "$err" >&2; return 1 ;;
        esac
    done
    say "error: the apt lists lock was held for 10 minutes (who holds it: fuser -v /var/lib/apt/lists/lock)"
    return 1
}
