#!/usr/bin/env bash
# Point `current` at a kept, complete release atomically (symlink + rename) and record it in
# history; then, when KEEP > 0, remove the releases beyond the newest KEEP named in history.
# usage: deploy_switch.sh RELEASES_DIR CURRENT LINK_DIR RELEASE KEEP
#   CURRENT    the `current` symlink; it points at LINK_DIR/RELEASE (LINK_DIR relative to it)
#   RELEASE    a release id, or "" for the newest release in history before the current one
# prints "current -> RELEASE"
# exit 3 (one line on stderr): the release is not kept, is incomplete (an interrupted deploy: no
# .complete marker), or there is no earlier release
set -eu
releases=$1 current=$2 link_dir=$3 release=$4 keep=$5

cur=$(readlink -- "$current" 2>/dev/null || true)
cur=${cur##*/}
if [ -z "$release" ]; then
  while read -r id; do
    if [ -n "$id" ] && [ "$id" != "$cur" ] && [ -d "$releases/$id" ]; then
      release=$id
      break
    fi
  done < <(tac -- "$releases/history" 2>/dev/null | awk "!seen[\$0]++")
  if [ -z "$release" ]; then
    echo "no earlier release to roll back to (current: ${cur:-none})" >&2
    exit 3
  fi
fi
if [ ! -f "$releases/$release/.complete" ]; then
  if [ -d "$releases/$release" ]; then
    echo "release $release is incomplete (no .complete marker: its deploy was interrupted); deploy it again or pick another from \`dflash-ops deploy --list\`" >&2
  else
    echo "release $release is not kept on the target; \`dflash-ops deploy --list\` shows the kept ones" >&2
  fi
  exit 3
fi

ln -sfn -- "$link_dir/$release" "$current.tmp"
mv -Tf -- "$current.tmp" "$current"
echo "$release" >>"$releases/history"
echo "current -> $release"

[ "$keep" -gt 0 ] || exit 0
kept=$(tac -- "$releases/history" | awk "!seen[\$0]++" | head -n "$keep")
for dir in "$releases"/*/; do
  dir=${dir%/}
  printf "%s\n" "$kept" | grep -qxF -- "${dir##*/}" || rm -rf -- "$dir"
done
