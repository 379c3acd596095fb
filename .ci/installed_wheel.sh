#!/usr/bin/env bash
# The package as `pip install` delivers it, not the checkout: build the wheel, install it (not
# editable) into a fresh virtualenv that reuses PYTHON's installed packages (torch and the rest,
# through a .pth file, so nothing is downloaded again), and from a directory outside the checkout
# run `relaunch --dry-run`, `relaunch` on the embedded `local` target up to the first training
# step, and `stop`.
# usage: bash .ci/installed_wheel.sh PYTHON
set -euo pipefail
python=${1:?usage: installed_wheel.sh PYTHON (the python whose packages the wheel reuses)}
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
work=$(mktemp -d /tmp/dflash-wheel.XXXXXX)
venv=$work/venv run_dir=$work/run
mkdir -p "$work/src" "$run_dir" "$work/home" "$work/tmux"
# a copy of the tracked files: a stale build/ of the checkout must not leak into the wheel
git -C "$repo" ls-files -z | (cd "$repo" && tar --null --ignore-failed-read -T - -cf -) | tar -xf - -C "$work/src"

wheel_env=(env -u DFLASH_OPS_INVENTORY -u DFLASH_OPS_PLAYBOOKS "HOME=$work/home" "TMUX_TMPDIR=$work/tmux")
cleanup() {
    if [ -x "$venv/bin/dflash-ops" ]; then (cd "$run_dir" && "${wheel_env[@]}" "$venv/bin/dflash-ops" stop >/dev/null 2>&1) || true; fi
    "${wheel_env[@]}" tmux -L dflash kill-server >/dev/null 2>&1 || true
    rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "installed_wheel: $1" >&2; exit 1; }

start=$SECONDS
"$python" -m pip wheel -q --no-deps "$work/src" -w "$work/dist"
wheel=$(ls "$work"/dist/dflash_ops-*.whl)
"$python" -m venv --without-pip "$venv"
site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
# PYTHON's package directories, after the new venv's own (its dflash_ops is the wheel's)
"$python" -c 'import sys; print("\n".join(p for p in sys.path if p.endswith("-packages")))' >"$site/reused.pth"
"$python" -m pip --python "$venv/bin/python" install -q --no-deps --ignore-installed "$wheel"
echo "== installed $(basename "$wheel") into $venv ($((SECONDS - start)) s)"

cd "$run_dir"  # no inventory.yaml here: the embedded `local` target
where=$("${wheel_env[@]}" "$venv/bin/python" -c 'import dflash_ops, trainer; print(dflash_ops.__file__, trainer.__file__)')
case "$where" in
    "$site/dflash_ops/__init__.py $site/trainer/__init__.py") ;;
    *) fail "the venv imports dflash_ops/trainer from elsewhere: $where" ;;
esac

"${wheel_env[@]}" "$venv/bin/dflash-ops" relaunch --dry-run >"$work/dry-run.log" 2>&1 || { cat "$work/dry-run.log"; fail "relaunch --dry-run failed"; }
grep -q "^relaunch: ran dflash_ops.commands.relaunch\$" "$work/dry-run.log" \
    || { head -3 "$work/dry-run.log"; fail "relaunch --dry-run did not run the relaunch command"; }
echo "== relaunch --dry-run: ok ($(wc -l <"$work/dry-run.log") lines)"

start=$SECONDS
"${wheel_env[@]}" "$venv/bin/dflash-ops" relaunch >"$work/relaunch.log" 2>&1 || { tail -20 "$work/relaunch.log"; fail "relaunch failed"; }
grep -q '\] wait_first_step \.\.\. ok' "$work/relaunch.log" || { tail -20 "$work/relaunch.log"; fail "relaunch did not reach the first step"; }
tail -3 "$work/relaunch.log"
echo "== relaunch from the wheel: first step reached ($((SECONDS - start)) s)"

"${wheel_env[@]}" "$venv/bin/dflash-ops" stop >"$work/stop.log" 2>&1 || { cat "$work/stop.log"; fail "stop failed"; }
grep -q "^stop: ran dflash_ops.commands.stop\$" "$work/stop.log" || { cat "$work/stop.log"; fail "stop did not run the stop command"; }
tail -1 "$work/stop.log"
echo "== installed wheel: relaunch --dry-run, relaunch and stop passed"
