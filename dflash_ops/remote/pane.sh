#!/usr/bin/env bash
# What runs inside the job's tmux pane (started by launch.sh): the trainer, its output appended to
# LOG; when the trainer has marked the run complete, the job state becomes `finished`.
# usage: pane.sh LOG RUN MODE METRICS OUT FINISHED_MARKER STATE_FILE FINISHED_STATE
#                WORKDIR RUN_DIR_WORD ENV... -- TRAINER_ARGV...
#   MODE            resume: add --resume when OUT (the run dir) holds a checkpoint; fresh: never
#   FINISHED_MARKER the file the trainer leaves in OUT when the run is complete
#   FINISHED_STATE  the job state JSON written then, with the slot @now@ for the time
#   RUN_DIR_WORD    stands for OUT in TRAINER_ARGV
#   ENV             NAME=VALUE words exported for the trainer
# exit: the trainer's own code
# No `set -e`: a failing trainer is what this script reports (in the log and its exit code).
set -u
log=$1 run=$2 mode=$3 metrics=$4 out=$5 finished_marker=$6 state_file=$7 finished_state=$8
workdir=$9 run_dir_word=${10}
shift 10
while [ "$1" != -- ]; do
  export "${1?}"
  shift
done
shift
trainer=("${@//"$run_dir_word"/"$out"}")

cd "$workdir" || exit
extra=()
if [ "$mode" = resume ] && ls -d "$out"/checkpoints/step-* >/dev/null 2>&1; then extra=(--resume); fi
echo "[dflash-ops] $(date -Is) launching run $run:" "${trainer[@]}" "${extra[*]}" >"$log"
"${trainer[@]}" --metrics-file "$metrics" "${extra[@]}" >>"$log" 2>&1
code=$?
echo "[dflash-ops] $(date -Is) trainer exited with code $code" >>"$log"
if [ -e "$finished_marker" ]; then
  state=${finished_state//@now@/$(date +%s)}
  printf "%s\n" "$state" >"$state_file.tmp.$$" && mv -f -T "$state_file.tmp.$$" "$state_file"
fi
exit $code
