#!/usr/bin/env bash
# The kept, complete releases, most recently deployed first, one per line:
#   <id> <deployed: unix time of its .complete> <1 if current, else 0>
# usage: deploy_list.sh RELEASES_DIR CURRENT
set -eu
releases=$1 current=$2

cur=$(readlink -- "$current" 2>/dev/null || true)
cur=${cur##*/}
[ -f "$releases/history" ] || exit 0
tac -- "$releases/history" | awk "!seen[\$0]++" | while read -r id; do
  [ -f "$releases/$id/.complete" ] || continue
  is_current=0
  [ "$id" != "$cur" ] || is_current=1
  printf "%s %s %s\n" "$id" "$(stat -c %Y -- "$releases/$id/.complete")" "$is_current"
done
