#!/usr/bin/env bash
# Unpack a pushed trainer tarball into its release directory once its checksum matches; a release
# already complete is kept as it is. deploy_switch.sh then makes it current.
# usage: deploy_install.sh RELEASES_DIR RELEASE_ID SHA256 TARBALL
# exit 3: the tarball's checksum does not match (nothing is unpacked)
set -eu
releases=$1 release=$releases/$2 sha256=$3 tarball=$4

cd -- "$releases"
echo "$sha256  ${tarball##*/}" | sha256sum -c --quiet - >&2 || {
  echo "checksum mismatch for $tarball" >&2
  exit 3
}
# .complete is written last, inside the temp dir, so a release dir without it never looks usable
if [ ! -f "$release/.complete" ]; then
  rm -rf -- "$release.tmp" && mkdir -p -- "$release.tmp"
  tar -xzf "$tarball" -C "$release.tmp"
  echo "$sha256" >"$release.tmp/.complete"
  rm -rf -- "$release" && mv -- "$release.tmp" "$release"
fi
rm -f -- "$tarball"
