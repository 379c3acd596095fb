#!/usr/bin/env bash
# Run on the Proxmox host: the host's GPU query first, then the probe in the container, in one
# round trip. Prints "<query exit code> <query output, base64>" on one line, then whatever the
# container command prints.
# usage: probe_on_host.sh CONTAINER_COMMAND QUERY_ARGV...
#   CONTAINER_COMMAND  a host shell command running the probe in the container (it reads the
#                      probe from stdin, so the query must not)
# exit: the container command's own code
# No `set -e`: the query's failure is part of the answer.
set -u
container_command=$1
shift

gpu=$("$@" 2>&1 </dev/null)
rc=$?
printf "%s %s\n" "$rc" "$(printf "%s" "$gpu" | base64 -w0)"
exec bash -c "$container_command"
