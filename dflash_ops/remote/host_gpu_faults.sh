#!/usr/bin/env bash
# Run on the Proxmox host (gpu_query_on: host), whose nvidia-smi and kernel log are the machine's own:
# the GPU fault counters, the row remapper and the kernel log's Xid lines, raw
# (dflash_ops.observe.gpu_faults.parse_host_answer reads them).
# usage: host_gpu_faults.sh XID_MARK MAX_LINES FAULT_QUERY... -- REMAP_QUERY... -- KERNEL_LOG... [-- KERNEL_LOG...]
# prints: "@fault RC" and that query's output; "@remap RC" and its output; "@uptime SECONDS"; then for
# each kernel log reader tried in turn "@kernel RC INDEX" and its Xid lines (the first reader that
# answers) or its output (one that failed)
# exit: 0; every failure is part of the answer
set -u
mark=$1
max_lines=$2
shift 2

group() {
  # the words of "$@" up to the next --, into the array `words`; `rest` counts what was taken
  words=()
  rest=0
  while [ $# -gt 0 ] && [ "$1" != -- ]; do
    words+=("$1")
    shift
    rest=$((rest + 1))
  done
  [ $# -gt 0 ] && rest=$((rest + 1))
  return 0
}

for query in fault remap; do
  group "$@"
  shift "$rest"
  out=$("${words[@]}" 2>&1 </dev/null)
  echo "@$query $?"
  printf "%s\n" "$out"
done

echo "@uptime $(cut -d" " -f1 /proc/uptime 2>/dev/null)"
index=0
while [ $# -gt 0 ]; do
  group "$@"
  shift "$rest"
  out=$("${words[@]}" 2>&1 </dev/null)
  rc=$?
  if [ "$rc" = 0 ] && [ -z "$out" ]; then
    # a kernel log always has boot messages: this one is not readable
    rc=1
    out="no kernel messages readable"
  fi
  echo "@kernel $rc $index"
  if [ "$rc" = 0 ]; then
    printf "%s\n" "$out" | grep -F -- "$mark" | tail -n "$max_lines"
    exit 0
  fi
  printf "%s\n" "$out" | head -n 1
  index=$((index + 1))
done
exit 0
