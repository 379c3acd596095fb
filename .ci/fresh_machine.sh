#!/usr/bin/env bash
# The README's first set-up command (read from README.md, so the two cannot drift), run twice the
# way a fresh machine runs it: a copy of the repository's tracked files (what a clone holds), under
# `env -i` with the stock PATH (so /usr/bin/python3, the system's PEP 668 python, is the python3
# found; no pyenv), and a throwaway HOME. Each run must reach the first training step, get an
# answer from `status` and end with the line saying how to run dflash-ops again.
# usage: bash .ci/fresh_machine.sh                  (prints the time of each run and the tail of its output)
#        bash .ci/fresh_machine.sh --print-command  (only prints the command, as read from the README)
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

command=$(awk '/^## Set up/ { in_setup = 1 }
               in_setup && /^```sh$/ { while ((getline line) > 0 && line != "```") print line; exit }' \
    "$repo/README.md")
[ -n "$command" ] || { echo "fresh_machine: no \`\`\`sh block under '## Set up' in README.md" >&2; exit 1; }
if [ "${1:-}" = --print-command ]; then printf '%s\n' "$command"; exit 0; fi

stock_path=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
# a python3 in /usr/local/bin would shadow the system one a stock machine has
if [ -e /usr/local/bin/python3 ]; then stock_path=/usr/bin:$stock_path; fi

work=$(mktemp -d /tmp/dflash-fresh.XXXXXX)
clone=$work/dflash-ops home=$work/home tmux_dir=$work/tmux
mkdir -p "$clone" "$home" "$tmux_dir"
# this machine's pip settings (an index mirror, say) are part of the machine, not of the project
for conf in .config/pip .pip; do
    if [ -d "$HOME/$conf" ]; then mkdir -p "$home/$(dirname "$conf")" && cp -r "$HOME/$conf" "$home/$conf"; fi
done
git -C "$repo" ls-files -z | (cd "$repo" && tar --null --ignore-failed-read -T - -cf -) | tar -xf - -C "$clone"

# TMUX_TMPDIR gives this run its own tmux server, so nothing else on the machine is touched
fresh_env=(env -i "PATH=$stock_path" "HOME=$home" "TMUX_TMPDIR=$tmux_dir" "LANG=C.UTF-8")
cleanup() {
    if [ -x "$clone/.venv/bin/dflash-ops" ]; then
        (cd "$clone" && "${fresh_env[@]}" .venv/bin/dflash-ops stop >/dev/null 2>&1) || true
    fi
    "${fresh_env[@]}" tmux -L dflash kill-server >/dev/null 2>&1 || true
    rm -rf "$work"
}
trap cleanup EXIT

echo "== the README's first set-up command:"
printf '%s\n' "$command"
echo "== python3 on the stock PATH: $(PATH=$stock_path command -v python3) ($(PATH=$stock_path python3 --version))"

for attempt in 1 2; do
    echo "== run $attempt (env -i, PATH=$stock_path, fresh HOME, in a fresh copy of the repository)"
    start=$SECONDS
    set +e
    (cd "$clone" && "${fresh_env[@]}" bash -c "$command") >"$work/run-$attempt.log" 2>&1
    rc=$?
    set -e
    tail -n 15 "$work/run-$attempt.log"
    echo "== run $attempt: exit $rc after $((SECONDS - start)) s"
    fail() { echo "fresh_machine: run $attempt: $1 (the end of its output is above)" >&2; exit 1; }
    [ "$rc" -eq 0 ] || fail "the command exited $rc"
    grep -q '\] wait_first_step \.\.\. ok' "$work/run-$attempt.log" || fail "relaunch did not reach the first step"
    grep -q '^job: running, run ' "$work/run-$attempt.log" || fail "status did not show the running job"
    last=$(tail -n 1 "$work/run-$attempt.log")
    case "$last" in
        "dflash-ops is installed in $clone/.venv: run $clone/.venv/bin/dflash-ops"*) ;;
        *) fail "the last line does not say how to run dflash-ops again: $last" ;;
    esac
done
base=$("$clone/.venv/bin/python" -c 'import sys; print(sys.base_prefix)')
[ "$base" = /usr ] || { echo "fresh_machine: .venv was made from $base, not the system python" >&2; exit 1; }
echo "== fresh machine: both runs passed; .venv made from the system python ($base)"
