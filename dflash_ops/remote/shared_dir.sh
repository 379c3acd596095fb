#!/usr/bin/env bash
# Prove that a directory is one shared filesystem: each node writes a token file there and reads
# the others'. A multinode job's runs dir must be one (checkpoints and resume).
# usage: shared_dir.sh write DIR NAME TOKEN   make DIR, write TOKEN into DIR/NAME (whole, renamed into place)
#        shared_dir.sh read DIR NAME          print DIR/NAME (at most 200 bytes); exit 3 when absent
#        shared_dir.sh remove DIR NAME...     remove these files (a missing one is fine)
set -eu
action=$1 dir=$2
shift 2
case $action in
  write)
    name=$1 token=$2
    mkdir -p -- "$dir"
    printf "%s" "$token" >"$dir/$name.tmp.$$"
    mv -f -T -- "$dir/$name.tmp.$$" "$dir/$name"
    ;;
  read)
    name=$1
    if [ ! -f "$dir/$name" ]; then
      echo "no file $dir/$name" >&2
      exit 3
    fi
    head -c 200 -- "$dir/$name"
    ;;
  remove)
    for name in "$@"; do rm -f -- "${dir:?}/$name"; done
    ;;
  *)
    echo "unknown action $action" >&2
    exit 2
    ;;
esac
