#!/usr/bin/env bash
# Hold the job's lock (an flock on LOCK) for as long as stdin stays open: the dflash-ops command
# that runs this keeps its stdin open while it acts and closes it (or dies, and the connection
# with it) when done, which releases the lock. Prints one line first:
#   locked                 the lock is ours; WHO is written into LOCK for whoever finds it taken
#   busy HOLDER            another command holds it; HOLDER is the line it wrote (may be empty)
#   error TEXT             no lock could be taken (LOCK is not a plain file, no flock)
# usage: job_lock.sh LOCK WHO MAX_HOLD_S
#   MAX_HOLD_S  a lock whose holder vanished without closing the connection ends after this
set -u
lock=$1 who=$2 max_hold_s=$3

if ! command -v flock >/dev/null 2>&1; then
  echo "error flock (util-linux) is not installed on the target"
  exit 0
fi
mkdir -p -- "$(dirname -- "$lock")" 2>/dev/null
if [ -L "$lock" ] || { [ -e "$lock" ] && [ ! -f "$lock" ]; }; then
  echo "error $lock is not a regular file"
  exit 0
fi
if ! exec 9<>"$lock"; then
  echo "error cannot open $lock"
  exit 0
fi
if ! flock -n 9; then
  # the holder writes its line right after taking the lock: give it a moment
  for _ in 1 2 3 4 5; do
    holder=$(head -c 300 -- "$lock" 2>/dev/null | head -n 1)
    [ -n "$holder" ] && break
    sleep 0.1
  done
  echo "busy ${holder:-}"
  exit 0
fi
printf "%s\n" "$who" >"$lock"
echo locked
read -r -t "$max_hold_s" _ || true
: >"$lock" # released: nobody holds it (the lock itself goes with fd 9 when this ends)
