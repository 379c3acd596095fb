#!/usr/bin/env bash
# The target's side of the preflight checks, in one round trip: prints `name=value` lines
#   reach=ok
#   release=ok|missing (RELEASE_FILE given) or release=deployable|unwritable (WORKDIR)
#   free_kib=N       free space under WORKDIR (its nearest existing ancestor)
#   torch=VERSION or python_error=WHY   PYTHON running the code TORCH_CHECK
#   state=ok|not-a-file   STATE_FILE (the job state) is absent or a plain file, or something else
#   gdn_kernels=fla VERSION|none, causal-conv1d VERSION|none   the Gated DeltaNet kernel packages
#                    PYTHON has (GDN_CHECK reads package metadata, imports nothing)
# usage: preflight.sh WORKDIR PYTHON TORCH_CHECK STATE_FILE GDN_CHECK [RELEASE_FILE]
# No `set -e`: a failed check is an answer to print, not the end of the checks.
set -u
workdir=$1 python=$2 torch_check=$3 state_file=$4 gdn_check=$5 release_file=${6:-}

echo reach=ok
if [ -L "$state_file" ] || { [ -e "$state_file" ] && [ ! -f "$state_file" ]; }; then
  echo state=not-a-file
else
  echo state=ok
fi
if [ -n "$release_file" ]; then
  if [ -f "$release_file" ]; then echo release=ok; else echo release=missing; fi
elif mkdir -p "$workdir" 2>/dev/null && [ -w "$workdir" ]; then
  echo release=deployable
else
  echo release=unwritable
fi
d=$workdir
while [ ! -d "$d" ]; do d=$(dirname "$d"); done
echo "free_kib=$(df -Pk "$d" | awk "NR==2 {print \$4}")"
if [ -x "$python" ]; then
  if out=$(timeout 120 "$python" -c "$torch_check" 2>&1); then
    echo "torch=$(printf "%s" "$out" | tail -n 1)"
  else
    echo "python_error=$(printf "%s" "$out" | tail -n 1)"
  fi
else
  echo python_error=not installed
fi
if [ -x "$python" ] && gdn=$(timeout 30 "$python" -c "$gdn_check" 2>/dev/null); then
  echo "gdn_kernels=$(printf "%s" "$gdn" | tail -n 1)"
fi
