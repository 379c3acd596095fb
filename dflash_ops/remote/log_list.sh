#!/usr/bin/env bash
# The names in LOG_DIR on one line, each followed by "/", which no name holds (at most 4 MiB of
# them): the caller picks the newest train-NNNN.log by number.
# usage: log_list.sh LOG_DIR
set -u
dir=$1
case $dir in /*) ;; *) dir=./$dir ;; esac # find reads a leading "-" as an option
find "$dir" -mindepth 1 -maxdepth 1 -printf "%f/" 2>/dev/null | head -c 4194304
echo
