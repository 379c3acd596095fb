#!/usr/bin/env bash
# The run a multinode job launches on every node, chosen once in the shared runs dir as launch.sh
# chooses one for a single target: the newest unfinished run (MODE resume), else a new one.
# usage: choose_run.sh RUNS MODE RUN_FINISHED   prints NNNN (the run dir is created)
set -eu
runs=$1 mode=$2 run_finished=$3

mkdir -p -- "$runs"
last=
for dir in "$runs"/[0-9][0-9][0-9][0-9]*; do
  name=${dir##*/}
  case $name in
    *[!0-9]*) continue ;;
  esac
  [ -d "$dir" ] || continue # the pattern itself when nothing matched
  if [ -z "$last" ] || [ $((10#$name)) -gt $((10#$last)) ]; then last=$name; fi
done
if [ "$mode" = resume ] && [ -n "$last" ] && [ ! -e "$runs/$last/$run_finished" ]; then
  run=$last
else
  run=$(printf "%04d" $((10#${last:-0} + 1)))
fi
mkdir -p -- "$runs/$run"
echo "$run"
