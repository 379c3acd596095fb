#!/usr/bin/env bash
# Start the trainer in a detached tmux session: pick the run (the newest unfinished one when MODE
# is resume, else a new one), the next numbered log, create the cache dir with its marker, start
# the session running pane.sh, record the job state `running`; print the log's path.
# usage: launch.sh SOCKET SESSION TARGET LOGS LOG_PREFIX LOG_SUFFIX METRICS_SUFFIX RUNS LEGACY_RUN
#                  CACHE CACHE_MARKER MARKER_VALUE LAUNCHER_ENTRIES INDUCTOR TRITON MODE RUN_FINISHED
#                  STATE_FILE RUNNING_STATE FINISHED_STATE PANE_SCRIPT PANE_MARKER PANE_ARGS...
#   SOCKET, SESSION, TARGET  the job's tmux socket (-L), session name and exact target (=NAME)
#   LOGS/LOG_PREFIX NNNN LOG_SUFFIX  the numbered log; its metrics file swaps LOG_SUFFIX for
#                    METRICS_SUFFIX
#   RUNS/NNNN        the run directory; LEGACY_RUN moves to RUNS/0001 when RUNS does not exist
#   CACHE            made with CACHE_MARKER (holding MARKER_VALUE) when it is absent or holds only
#                    names matching LAUNCHER_ENTRIES (grep -E): purge-cache deletes only marked dirs
#   MODE             resume, fresh, or run=NNNN: that run (a multinode job chooses one run for all its
#                    nodes; the pane then resumes it as in resume mode)
#   RUN_FINISHED     the file the trainer leaves in a run it completed
#   RUNNING_STATE, FINISHED_STATE  job state JSON with the slots @run_number@ @run@ @log_number@
#                    (both), @pid@ and @now@ (running), @now@ (finished, filled in by the pane)
#   PANE_SCRIPT      the text of pane.sh; PANE_ARGS follow its own LOG ... FINISHED_STATE
#   PANE_MARKER      NAME=VALUE in the pane's own environment: proof that the pane's pid is the job's
# exit 3: the session is already running
set -eu
socket=$1 session=$2 target=$3 logs=$4 log_prefix=$5 log_suffix=$6 metrics_suffix=$7 runs=$8
legacy_run=$9 cache=${10} cache_marker=${11} marker_value=${12} launcher_entries=${13}
inductor=${14} triton=${15} mode=${16} run_finished=${17} state_file=${18} running_state=${19}
finished_state=${20} pane_script=${21} pane_marker=${22}
shift 22

if tmux -L "$socket" has-session -t "$target" 2>/dev/null; then
  echo "session $session is already running; stop it first" >&2
  exit 3
fi
if [ ! -e "$runs" ] && [ -d "$legacy_run/checkpoints" ]; then
  mv "$legacy_run" "$runs.tmp" && mkdir -p "$runs" && mv "$runs.tmp" "$runs/0001"
fi
mkdir -p "$logs" "$runs"
# an existing cache dir is adopted only when it holds nothing but what the launcher puts there
# shellcheck disable=SC2010  # a name with a newline reads as several names: all must be expected
if [ ! -e "$cache" ] || [ -z "$(ls -A "$cache" | grep -vxE "$launcher_entries" || true)" ]; then
  mkdir -p "$cache"
  [ -e "$cache_marker" ] || printf "%s\n" "$marker_value" >"$cache_marker"
fi
mkdir -p "$inductor" "$triton"

last=
for dir in "$runs"/[0-9][0-9][0-9][0-9]*; do
  name=${dir##*/}
  case $name in
    *[!0-9]*) continue ;;
  esac
  [ -e "$dir" ] || continue # the pattern itself when nothing matched
  if [ -z "$last" ] || [ $((10#$name)) -gt $((10#$last)) ]; then last=$name; fi
done
pane_mode=$mode
case $mode in
  run=*)
    run=${mode#run=} pane_mode=resume
    case $run in
      "" | ? | ?? | ??? | *[!0-9]*)
        echo "run $run is not a run number (NNNN)" >&2
        exit 2
        ;;
    esac
    ;;
  *)
    if [ "$mode" = resume ] && [ -n "$last" ] && [ ! -e "$runs/$last/$run_finished" ]; then
      run=$last
    else
      run=$(printf "%04d" $((10#${last:-0} + 1)))
    fi
    ;;
esac
mkdir -p "$runs/$run"

# the next number after every log AND every metrics file: a deleted log's metrics keep its number
last=0
for path in "$logs/$log_prefix"*; do
  number=${path##*/}
  number=${number#"$log_prefix"}
  number=${number%"$log_suffix"}
  number=${number%"$metrics_suffix"}
  case $number in
    "" | *[!0-9]*) continue ;;
  esac
  [ $((10#$number)) -le $((10#$last)) ] || last=$number
done
n=$(printf "%04d" $((10#$last + 1)))
log=$logs/$log_prefix$n$log_suffix
: >"$log"

fill() { # the slots this launch knows, in state template $1
  local state=$1
  state=${state//@run_number@/$((10#$run))}
  state=${state//@run@/$run}
  printf "%s" "${state//@log_number@/$n}"
}

# One tmux invocation (";" separates tmux commands), so remain-on-exit is set before the server
# can reap a pane that fails at once; it keeps a crashed pane (and its exit status) visible to
# status and health. The tmux server daemonizes, so the session outlives this ssh / pct exec call.
tmux -L "$socket" new-session -d -s "$session" -x 200 -y 50 \
  env "$pane_marker" bash -c "$pane_script" pane.sh "$log" "$run" "$pane_mode" "${log%"$log_suffix"}$metrics_suffix" \
  "$runs/$run" "$runs/$run/$run_finished" "$state_file" "$(fill "$finished_state")" "$@" \
  \; set-option -w -t "$target:" remain-on-exit on >/dev/null
pid=$(tmux -L "$socket" list-panes -s -t "$target:" -F "#{pane_pid}" 2>/dev/null | head -n 1)
state=$(fill "$running_state")
state=${state//@pid@/${pid:-0}}
state=${state//@now@/$(date +%s)}
printf "%s\n" "$state" >"$state_file.tmp.$$" && mv -f -T "$state_file.tmp.$$" "$state_file"
echo "$log"
