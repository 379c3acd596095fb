#!/usr/bin/env bash
# The size of a log, then its bytes after OFFSET up to that size.
# usage: log_chunk.sh PATH OFFSET
set -eu
path=$1 offset=$2

size=$(stat -c %s -- "$path")
echo "$size"
tail -c +$((offset + 1)) -- "$path" | head -c $((size - offset))
