#!/usr/bin/env bash
# Run on the Proxmox host: the host's GPU query and GPU fault query side by side, then the probe in
# the container, in one round trip. Prints "<query exit code> <query output, base64>" on one line,
# the same for the fault query on the next ("- -" where no temporary file could hold its answer),
# then whatever the container command prints.
# usage: probe_on_host.sh CONTAINER_COMMAND FAULTS_COMMAND QUERY_ARGV...
#   CONTAINER_COMMAND  a host shell command running the probe in the container (it reads the
#                      probe from stdin, so the queries must not)
#   FAULTS_COMMAND     a host shell command printing the GPU faults (remote/host_gpu_faults.sh)
# exit: the container command's own code
# No `set -e`: a query's failure is part of the answer.
set -u
container_command=$1
faults_command=$2
shift 2

faults_file=$(mktemp 2>/dev/null) || faults_file=
if [ -n "$faults_file" ]; then
  bash -c "$faults_command" </dev/null >"$faults_file" 2>&1 &
  faults_pid=$!
fi
gpu=$("$@" 2>&1 </dev/null)
rc=$?
printf "%s %s\n" "$rc" "$(printf "%s" "$gpu" | base64 -w0)"
if [ -n "$faults_file" ]; then
  wait "$faults_pid"
  faults_rc=$?
  printf "%s %s\n" "$faults_rc" "$(base64 -w0 <"$faults_file")"
  rm -f "$faults_file"
else
  echo "- -"
fi
exec bash -c "$container_command"
