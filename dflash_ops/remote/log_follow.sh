#!/usr/bin/env bash
# One poll of a follower: the job state on one line (at most MAX_BYTES+1 bytes; empty when the
# state file is absent or not a regular file), the names in LOG_DIR on one line (each followed by
# "/"), then PATH's size and its bytes after OFFSET up to that size.
# usage: log_follow.sh STATE_FILE MAX_BYTES LOG_DIR PATH OFFSET
set -eu
state=$1 max_bytes=$2 log_dir=$3 path=$4 offset=$5
case $log_dir in /*) ;; *) log_dir=./$log_dir ;; esac # find reads a leading "-" as an option

if [ -f "$state" ]; then head -c $((max_bytes + 1)) -- "$state" 2>/dev/null | tr "\n" " " || true; fi
echo
find "$log_dir" -mindepth 1 -maxdepth 1 -printf "%f/" 2>/dev/null | head -c 4194304 || true
echo
size=$(stat -c %s -- "$path")
echo "$size"
tail -c +$((offset + 1)) -- "$path" | head -c $((size - offset))
