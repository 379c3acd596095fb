"""Run ON EACH NODE of a multinode job before anything stops: what the node would run and whether it
reaches the rendezvous and the other nodes. Prints one JSON object.
A connect result "open" or "refused" proves the host reachable; "timeout", "unreachable", "dns" and
"error" do not."""

import errno
import hashlib
import json
import os
import platform
import socket
import sys

_UNREACHABLE = {errno.EHOSTUNREACH, errno.ENETUNREACH, errno.EHOSTDOWN, errno.ENETDOWN}


def _torch_version():
    try:
        from importlib import metadata

        return metadata.version("torch")
    except Exception as exc:  # noqa: BLE001 - not installed, or broken metadata: say which
        return "missing (%s)" % type(exc).__name__


def _release(current):
    try:
        return os.path.basename(os.readlink(current).rstrip("/")) or None
    except OSError:
        return None


def _sha256(path):
    if not path:
        return None
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    except OSError as exc:
        return "unreadable (%s)" % (exc.strerror or type(exc).__name__)
    return digest.hexdigest()


def connect(host, port, timeout_s):
    """(result, detail) of one TCP connect; see the module doc for the results."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return "dns", "cannot resolve %s: %s" % (host, exc.strerror or exc)
    except (OSError, UnicodeError) as exc:
        return "dns", "cannot resolve %s: %s" % (host, exc)
    last = ("error", "no address")
    for family, kind, proto, _, address in infos:
        sock = socket.socket(family, kind, proto)
        sock.settimeout(timeout_s)
        try:
            sock.connect(address)
            return "open", "connected to %s" % (address[0],)
        except ConnectionRefusedError:
            return "refused", "%s answered: connection refused (nothing listens yet)" % (address[0],)
        except socket.timeout:
            last = ("timeout", "no answer from %s within %g s" % (address[0], timeout_s))
        except OSError as exc:
            kind_ = "unreachable" if exc.errno in _UNREACHABLE else "error"
            last = (kind_, "%s: %s" % (address[0], exc.strerror or exc))
        finally:
            sock.close()
    return last


def main(args):
    timeout_s = float(args.get("timeout_s") or 5)
    answer = {
        "python": "%s %s" % (platform.python_implementation(), platform.python_version()),
        "torch": _torch_version(),
        "release": _release(args.get("current") or ""),
        "config_sha256": _sha256(args.get("config") or ""),
        "fqdn": socket.getfqdn(),
        "hostname": socket.gethostname(),
        "connect": [],
    }
    for host, port in args.get("connect") or []:
        result, detail = connect(str(host), int(port), timeout_s)
        answer["connect"].append({"host": host, "port": port, "result": result, "detail": detail})
    return answer


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))
