#!/usr/bin/env bash
# The size of a log, then its last LINES lines up to that size (so a follower continues exactly
# where this read ended).
# usage: log_read.sh PATH LINES
# exit 3: PATH is not a regular file; stdout says what it is ("does not exist", "is a directory")
set -eu
path=$1 lines=$2

if [ ! -e "$path" ]; then
  echo "does not exist"
  exit 3
fi
if [ ! -f "$path" ]; then
  echo "is a $(stat -c %F -- "$path")"
  exit 3
fi
size=$(stat -c %s -- "$path")
echo "$size"
head -c "$size" -- "$path" | tail -n "$lines"
