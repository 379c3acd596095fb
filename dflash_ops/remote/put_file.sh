#!/usr/bin/env bash
# Store stdin at DEST atomically: a temp file in the same directory, renamed over DEST. The size
# check keeps a transfer cut short (a lost connection: the reader just sees EOF) from replacing a
# good file with a truncated one.
# usage: put_file.sh DEST MODE SIZE   (MODE in octal, SIZE in bytes)
# exit 1: fewer or more than SIZE bytes arrived; DEST is left unchanged
set -eu
dest=$1 mode=$2 size=$3

dir=$(dirname -- "$dest")
mkdir -p -- "$dir"
tmp=$(mktemp -- "$dir/.$(basename -- "$dest").tmp.XXXXXX")
remove_tmp() { rm -f -- "$tmp"; }
trap remove_tmp EXIT
cat >"$tmp"
got=$(stat -c %s -- "$tmp")
if [ "$got" != "$size" ]; then
  echo "put: received $got of $size bytes; $dest left unchanged" >&2
  exit 1
fi
chmod "$mode" -- "$tmp"
# -T: a DEST that is a directory fails the put (never a file moved inside it)
mv -f -T -- "$tmp" "$dest"
trap - EXIT
