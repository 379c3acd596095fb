#!/usr/bin/env bash
# Run the Python program on stdin (remote.bundle(SCRIPT)) with the job's python, or python3 when
# that is not installed yet (e.g. before the first deploy); its one argument is ARGS_JSON.
# usage: run_python.sh PYTHON SCRIPT WHO ARGS_JSON   (SCRIPT only names what stdin carries)
# exit 127: neither PYTHON nor python3 is installed (WHO names the caller in the message)
set -eu
py=$1 who=$3 args=$4

if [ ! -x "$py" ]; then
  py=$(command -v python3) || {
    printf "%s: neither %s nor python3 is installed\n" "$who" "$1" >&2
    exit 127
  }
fi
exec "$py" - "$args"
