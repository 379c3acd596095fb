#!/usr/bin/env bash
# What runs inside the job's tmux pane (started by launch_job.py): the trainer, its output appended
# to LOG; when the trainer has marked the run complete, the job state becomes `finished`.
# usage: pane.sh LOG RUN MODE METRICS OUT FINISHED_MARKER STATE_FILE FINISHED_STATE PYTHON
#                STATE_WRITER WORKDIR ENV... -- TRAINER_ARGV...
#   MODE            resume: add --resume when OUT (the run dir) holds a checkpoint; fresh: never
#   FINISHED_MARKER the file the trainer leaves in OUT when the run is complete
#   FINISHED_STATE  the job state `finished` as JSON, all but its time; PYTHON runs the program
#                   STATE_WRITER (remote/state_write.py) to write it with the time added
#   ENV             NAME=VALUE words exported for the trainer
# exit: the trainer's own code
# No `set -e`: a failing trainer is what this script reports (in the log and its exit code).
set -u
log=$1 run=$2 mode=$3 metrics=$4 out=$5 finished_marker=$6 state_file=$7 finished_state=$8
python=$9 state_writer=${10} workdir=${11}
shift 11
while [ "$1" != -- ]; do
  export "${1?}"
  shift
done
shift

cd "$workdir" || exit
extra=()
if [ "$mode" = resume ] && ls -d "$out"/checkpoints/step-* >/dev/null 2>&1; then extra=(--resume); fi
echo "[dflash-ops] $(date -Is) launching run $run:" "$@" "${extra[*]}" >"$log"
# what `dflash-ops attach` shows: the output goes to the log, not to this pane
echo "[dflash-ops] run $run: the trainer writes to $log, not here; \`dflash-ops tail-log -f\` follows it"
"$@" --metrics-file "$metrics" "${extra[@]}" >>"$log" 2>&1
code=$?
echo "[dflash-ops] $(date -Is) trainer exited with code $code" | tee -a "$log"
if [ -e "$finished_marker" ]; then
  "$python" -I -c "$state_writer" "$state_file" "$finished_state" when
fi
exit $code
