#!/usr/bin/env bash
# Unpack a pushed trainer tarball into its release directory once its checksum matches; a release
# already complete is kept as it is. deploy_switch.sh then makes it current.
# usage: deploy_install.sh RELEASES_DIR RELEASE_ID SHA256 TARBALL
# exit 3 (one line on stderr): the tarball's checksum does not match; it is removed, nothing unpacked
set -eu
releases=$1 release=$releases/$2 sha256=$3 tarball=$4

cd -- "$releases"
got=$(sha256sum -- "${tarball##*/}" 2>/dev/null || true)
got=${got%% *}
if [ "$got" != "$sha256" ]; then
  rm -f -- "$tarball"
  echo "checksum mismatch for $tarball (expected ${sha256:0:12}..., got ${got:-nothing}): the upload was corrupted and is removed; deploy again" >&2
  exit 3
fi
# .complete is written last, inside the temp dir, so a release dir without it never looks usable
if [ ! -f "$release/.complete" ]; then
  rm -rf -- "$release.tmp" && mkdir -p -- "$release.tmp"
  tar -xzf "$tarball" -C "$release.tmp"
  echo "$sha256" >"$release.tmp/.complete"
  rm -rf -- "$release" && mv -- "$release.tmp" "$release"
fi
rm -f -- "$tarball"
