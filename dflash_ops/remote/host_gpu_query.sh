#!/usr/bin/env bash
# Run on the Proxmox host: the GPUs, "@@", the compute apps (host pids), "@@", then for each app
# "@pid PID", its /proc/PID/cgroup and its NSpid line (dflash_ops.observe.gpu.parse_host_gpu_query reads it).
# usage: host_gpu_query.sh GPU_QUERY_ARGV... -- APPS_QUERY_ARGV...
# exit: a failing query's own code, else 0
# No `set -e`: an app that ends between the query and its /proc read is no failure (the parser
# reports it as gone).
set -u
gpu_query=()
while [ "$1" != -- ]; do
  gpu_query+=("$1")
  shift
done
shift

"${gpu_query[@]}" || exit $?
echo @@
apps=$("$@") || exit $?
printf "%s\n" "$apps"
echo @@
for pid in $(printf "%s\n" "$apps" | cut -d, -f1); do
  echo "@pid $pid"
  cat "/proc/$pid/cgroup" 2>/dev/null
  grep "^NSpid:" "/proc/$pid/status" 2>/dev/null
done
exit 0
