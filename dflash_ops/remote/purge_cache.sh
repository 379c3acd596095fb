#!/usr/bin/env bash
# Remove a compile-cache dir only if it holds the marker the launcher puts there; prints what it
# found: absent, purged or unmarked (left alone).
# usage: purge_cache.sh DIR MARKER
set -eu
dir=$1 marker=$2

if [ ! -e "$dir" ]; then
  echo absent
elif [ -f "$marker" ]; then
  rm -rf -- "$dir" && echo purged
else
  echo unmarked
fi
