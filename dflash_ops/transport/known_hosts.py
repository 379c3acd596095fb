"""Read an OpenSSH known_hosts file the way `ssh` does, for one host: each line judged on its own
(paramiko's loader stops at the first it cannot read); `@revoked` keys refuse the server."""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import hmac
import re

import paramiko

REVOKED = "@revoked"
CERT_AUTHORITY = "@cert-authority"


@dataclasses.dataclass(frozen=True)
class HostKeys:
    """The keys a known_hosts file holds for one host entry (`host` or `[host]:port`)."""

    entry: str
    keys: tuple[paramiko.PKey, ...] = ()  # trusted for this host, revoked ones left out
    revoked: tuple[paramiko.PKey, ...] = ()  # `@revoked` for this host: always refused

    def is_revoked(self, key: paramiko.PKey) -> bool:
        return any(key == r for r in self.revoked)


def _hashed_name_matches(field: str, entry: str) -> bool:
    """`|1|salt|hash` (HashKnownHosts): HMAC-SHA1 of the name keyed with the salt."""
    try:
        _, magic, salt, digest = field.split("|")
        if magic != "1":
            return False
        want = base64.b64decode(digest, validate=True)
        mac = hmac.new(base64.b64decode(salt, validate=True), entry.encode(), hashlib.sha1).digest()
    except (ValueError, binascii.Error):
        return False  # a corrupt hashed name matches nothing
    return hmac.compare_digest(mac, want)


def _wildcard(pattern: str) -> re.Pattern:
    """`*` and `?` only: `[host]:port` brackets are literal, unlike fnmatch."""
    return re.compile("".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pattern))


def names_match(field: str, entry: str) -> bool:
    """OpenSSH host patterns: comma-separated, `*`/`?`, `!` rules the line out, or one hashed name."""
    if field.startswith("|"):
        return _hashed_name_matches(field, entry)
    entry = entry.lower()
    matched = False
    for pattern in field.lower().split(","):
        negated = pattern.startswith("!")
        if _wildcard(pattern[1:] if negated else pattern).fullmatch(entry):
            if negated:
                return False
            matched = True
    return matched


def _key(key_type: str, blob: str) -> paramiko.PKey | None:
    try:
        return paramiko.PKey.from_type_string(key_type, base64.b64decode(blob, validate=True))
    except (ValueError, binascii.Error, paramiko.SSHException):
        return None  # corrupt or a key type paramiko does not know: skipped, as ssh skips it


def read_host_keys(path: str, entry: str) -> HostKeys:
    """The keys `path` holds for `entry`. Raises OSError when the file cannot be read."""
    with open(path, "rb") as f:
        text = f.read().decode("utf-8", "replace")
    keys: list[paramiko.PKey] = []
    revoked: list[paramiko.PKey] = []
    for line in text.splitlines():
        fields = line.split()
        if not fields or fields[0].startswith("#"):
            continue
        marker = fields.pop(0) if fields[0].startswith("@") else None
        if len(fields) < 3 or marker == CERT_AUTHORITY or marker not in (None, REVOKED):
            continue
        names, key_type, blob = fields[:3]
        if not names_match(names, entry):
            continue
        key = _key(key_type, blob)
        if key is not None:
            (revoked if marker == REVOKED else keys).append(key)
    return HostKeys(entry, tuple(k for k in keys if not any(k == r for r in revoked)), tuple(revoked))
