"""SshTransport against a real sshd: every way of failing to get in gives its own clear error."""
from __future__ import annotations

import dataclasses
import subprocess
import threading
import time

import paramiko
import pytest

from dflash_ops.errors import AuthError, ConnectError, HostKeyError, InputError
from dflash_ops.job.model import HostSpec, JumpHost
from dflash_ops.transport.ssh import SshTransport

try:
    from tests import sshd as sshd_helpers
except ImportError:
    import sshd as sshd_helpers


def _run(spec: HostSpec, script: str = "echo ok", name: str = "box", step: str = "probe"):
    with SshTransport(name, spec) as t:
        return t.run(script, step=step)


def _no_raw_cause(exc: BaseException) -> None:
    # the CLI prints str(error): a paramiko traceback must not hide behind it
    assert exc.__cause__ is None and exc.__suppress_context__


def test_runs_and_names_the_target(ssh_spec):
    result = _run(ssh_spec, "echo ok; echo warn >&2; exit 5")
    assert (result.exit_code, result.stdout, result.stderr) == (5, "ok\n", "warn\n")


def test_one_connection_serves_every_run(ssh_spec):
    # SSH_CLIENT holds the client's source port: the same port means the same TCP connection.
    with SshTransport("box", ssh_spec) as t:
        ports = {t.check("echo $SSH_CLIENT").stdout.split()[1] for _ in range(3)}
    assert len(ports) == 1


def test_reconnects_once_when_the_connection_went_stale(ssh_spec):
    with SshTransport("box", ssh_spec) as t:
        first = t.check("echo $SSH_CLIENT").stdout.split()[1]
        t._conn.transport.close()  # what a server restart or a NAT timeout leaves behind
        second = t.check("echo $SSH_CLIENT").stdout.split()[1]
    assert first != second


def test_wrong_key_is_an_auth_error(ssh_spec, tmp_path):
    other = sshd_helpers.make_keypair(tmp_path / "not_authorized")
    with pytest.raises(AuthError) as info:
        _run(dataclasses.replace(ssh_spec, identity_file=str(other)))
    err = info.value
    assert (err.target, err.step) == ("box", "probe")
    assert str(other) in str(err) and "'root'" in str(err) and "authorized_keys" in str(err)
    _no_raw_cause(err)


def test_closed_port_is_a_connect_error(ssh_spec):
    port = sshd_helpers.free_port()  # nothing listens there
    with pytest.raises(ConnectError) as info:
        _run(dataclasses.replace(ssh_spec, port=port))
    assert "refused" in str(info.value) and str(port) in str(info.value)
    _no_raw_cause(info.value)


def test_unresolvable_host_is_a_connect_error(ssh_spec):
    with pytest.raises(ConnectError) as info:
        _run(dataclasses.replace(ssh_spec, host="no-such-host.invalid"))
    assert "cannot resolve" in str(info.value) and "ssh.host" in str(info.value)


def test_changed_host_key_is_refused_with_the_fix(ssh_spec, sshd_server, sshd_server_b, tmp_path):
    # known_hosts files server B's key under server A's name: to us, A's key has changed.
    entry = f"[127.0.0.1]:{sshd_server.port}"
    kh = tmp_path / "known_hosts"
    kh.write_text(sshd_server_b.known_hosts_line().replace(f"[127.0.0.1]:{sshd_server_b.port}", entry))
    for policy in ("strict", "accept-new"):  # accept-new accepts NEW hosts, never changed keys
        with pytest.raises(HostKeyError) as info:
            _run(dataclasses.replace(ssh_spec, known_hosts_file=str(kh), host_key_policy=policy))
        text = str(info.value)
        assert "CHANGED" in text and f"ssh-keygen -f {kh} -R '{entry}'" in text
        _no_raw_cause(info.value)
    assert kh.read_text().count("\n") == 1  # nothing was added


def test_unknown_host_under_strict_is_refused(ssh_spec, tmp_path):
    for kh in (tmp_path / "empty_known_hosts", tmp_path / "missing" / "known_hosts"):
        if kh.name.startswith("empty"):
            kh.write_text("")
        with pytest.raises(HostKeyError) as info:
            _run(dataclasses.replace(ssh_spec, known_hosts_file=str(kh)))
        text = str(info.value)
        assert str(kh) in text and "ssh-keyscan" in text and "accept-new" in text and "SHA256:" in text
    assert not (tmp_path / "missing").exists()


def test_unknown_host_under_accept_new_is_recorded(ssh_spec, sshd_server, tmp_path):
    kh = tmp_path / "ssh" / "known_hosts"  # not there yet: created, like OpenSSH does
    spec = dataclasses.replace(ssh_spec, known_hosts_file=str(kh), host_key_policy="accept-new")
    assert _run(spec).stdout == "ok\n"
    assert kh.read_text() == sshd_server.known_hosts_line()
    # from now on even strict checking knows the host
    assert _run(dataclasses.replace(spec, host_key_policy="strict")).stdout == "ok\n"
    _run(spec)
    assert kh.read_text() == sshd_server.known_hosts_line()  # recorded once, not again


def test_accept_new_keeps_existing_lines(ssh_spec, sshd_server, tmp_path):
    kh = tmp_path / "known_hosts"
    other_key = (tmp_path / "other.pub")
    other_key.write_text(sshd_server.host_key_pub.read_text())
    hashed = paramiko.HostKeys.hash_host("other.example")  # a HashKnownHosts entry, as OpenSSH writes it
    kh.write_text("# my hosts\n" + sshd_helpers.known_hosts_line("x", 22, other_key).replace("x", hashed, 1))
    before = kh.read_text()
    _run(dataclasses.replace(ssh_spec, known_hosts_file=str(kh), host_key_policy="accept-new"))
    assert kh.read_text() == before + sshd_server.known_hosts_line()


def _other_key_line(tmp_path, names: str, marker: str = "") -> str:
    key = sshd_helpers.make_keypair(tmp_path / f"other-{len(list(tmp_path.iterdir()))}")
    kind, blob = (tmp_path / f"{key.name}.pub").read_text().split()[:2]
    return f"{marker + ' ' if marker else ''}{names} {kind} {blob}\n"


def test_known_hosts_lines_that_do_not_apply_are_skipped_as_ssh_does(ssh_spec, sshd_server, tmp_path):
    kh = tmp_path / "known_hosts"
    kh.write_text("# my hosts\n\n"
                  + _other_key_line(tmp_path, "*.example.com", "@cert-authority")
                  + _other_key_line(tmp_path, "*", "@revoked")
                  + "other.example ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIExample\n"  # bad padding
                  + "|1|not-base64|x ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIExample\n"
                  + "short-line ssh-ed25519\n"
                  + "odd.example ssh-unknown-type AAAA\n"
                  + _other_key_line(tmp_path, "!127.0.0.1,*")  # ruled out for us by the negation
                  + sshd_server.known_hosts_line().rstrip("\n") + " a trailing comment\n")
    assert _run(dataclasses.replace(ssh_spec, known_hosts_file=str(kh))).stdout == "ok\n"


def test_hashed_and_pattern_names_are_matched(ssh_spec, sshd_server, tmp_path):
    kh = tmp_path / "known_hosts"
    kh.write_text(sshd_server.known_hosts_line())
    subprocess.run(["ssh-keygen", "-q", "-H", "-f", str(kh)], check=True, capture_output=True)
    assert "|1|" in kh.read_text()
    assert _run(dataclasses.replace(ssh_spec, known_hosts_file=str(kh))).stdout == "ok\n"
    kh.write_text(sshd_server.known_hosts_line().replace("[127.0.0.1]", "[127.0.0.?]"))
    assert _run(dataclasses.replace(ssh_spec, known_hosts_file=str(kh))).stdout == "ok\n"


@pytest.mark.parametrize("policy", ["strict", "accept-new"])
def test_revoked_host_key_is_refused_saying_so(ssh_spec, sshd_server, tmp_path, policy):
    kh = tmp_path / "known_hosts"
    kind, blob = sshd_server.host_key_pub.read_text().split()[:2]
    kh.write_text(sshd_server.known_hosts_line() + f"@revoked * {kind} {blob}\n")
    before = kh.read_text()
    with pytest.raises(HostKeyError) as info:
        _run(dataclasses.replace(ssh_spec, known_hosts_file=str(kh), host_key_policy=policy))
    assert "@revoked" in str(info.value) and str(kh) in str(info.value)
    assert kh.read_text() == before  # accept-new records nothing


def test_unreadable_known_hosts_is_named(ssh_spec, tmp_path):
    with pytest.raises(HostKeyError) as info:
        _run(dataclasses.replace(ssh_spec, known_hosts_file=str(tmp_path)))  # a directory
    assert f"cannot read {tmp_path}" in str(info.value) and "ssh.known_hosts_file" in str(info.value)


def test_policy_off_trusts_without_recording(ssh_spec, tmp_path):
    kh = tmp_path / "known_hosts"
    kh.write_text("")
    assert _run(dataclasses.replace(ssh_spec, known_hosts_file=str(kh), host_key_policy="off")).stdout == "ok\n"
    assert kh.read_text() == ""


def test_jump_host_reaches_the_second_server(ssh_spec, ssh_spec_b, sshd_server, sshd_server_b):
    spec = dataclasses.replace(ssh_spec_b, jump=JumpHost("127.0.0.1", sshd_server.port, "root"))
    with SshTransport("via-jump", spec) as t:
        # the session runs on B (its port), and the jump connection to A is up
        assert t.check("echo $SSH_CONNECTION").stdout.split()[3] == str(sshd_server_b.port)
        assert t._gateway is not None and t._gateway.is_connected
    assert "-J root@127.0.0.1:%d" % sshd_server.port in SshTransport("via-jump", spec).command_line("true")


def test_jump_host_failures_say_jump_host(ssh_spec_b):
    closed = sshd_helpers.free_port()
    with pytest.raises(ConnectError) as info:
        _run(dataclasses.replace(ssh_spec_b, jump=JumpHost("127.0.0.1", closed, "root")))
    assert "jump host" in str(info.value) and str(closed) in str(info.value)


def test_background_output_holder_does_not_hang_the_run(ssh_spec):
    # `sleep 20 &` keeps the session's stdout open; plain ssh would wait for it.
    start = time.monotonic()
    result = _run(ssh_spec, "echo started; sleep 20 &")
    assert result.stdout == "started\n" and result.exit_code == 0
    assert time.monotonic() - start < 5


@pytest.mark.parametrize("field,value,words", [
    ("host_key_policy", "yolo", ["host_key_policy", "strict"]),
    ("jump", "user@@host:xx", ["jump", "user@host:port"]),
    ("host", '""', ["host"]),
])
def test_bad_host_settings_are_input_errors(field, value, words):
    """The inventory is the one place that checks a target: the transport gets only good ones."""
    from dflash_ops.inventory.load import load_inventory_text

    host = "" if field == "host" else "    host: h\n"
    text = (f"targets:\n  box:\n    transport: ssh\n{host}    {field}: {value}\n"
            "    job: {workdir: /w, python: /usr/bin/python3, config: tiny-cpu}\n")
    with pytest.raises(InputError) as info:
        load_inventory_text(text)
    assert all(w in str(info.value) for w in words) and "'box'" in str(info.value), str(info.value)


def test_identity_file_that_is_a_directory_says_so(ssh_spec, tmp_path):
    with pytest.raises(InputError) as info:
        _run(dataclasses.replace(ssh_spec, identity_file=str(tmp_path)))
    assert "ssh.identity_file" in str(info.value) and "is a directory" in str(info.value)


def test_missing_identity_file_is_an_input_error(ssh_spec, tmp_path):
    with pytest.raises(InputError) as info:
        _run(dataclasses.replace(ssh_spec, identity_file=str(tmp_path / "nope")))
    assert "ssh.identity_file" in str(info.value) and "nope" in str(info.value)


def test_missing_tools_fail_with_the_fix():
    with pytest.raises(sshd_helpers.MissingTool) as info:
        sshd_helpers.require_tools("no-such-tool-dflash")
    assert "no-such-tool-dflash" in str(info.value) and "DFLASH_SKIP_SSH_TESTS=1" in str(info.value)


def test_skip_switch_skips_instead_of_failing():
    import os
    import subprocess
    import sys
    env = {**os.environ, "DFLASH_SKIP_SSH_TESTS": "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/test_transport_ssh.py::test_runs_and_names_the_target"],
                          capture_output=True, text=True, env=env, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert "1 skipped" in done.stdout, done.stdout + done.stderr


def test_a_server_without_a_banner_is_named_and_nothing_else_is_printed(silent_server, ssh_spec, capfd):
    spec = dataclasses.replace(ssh_spec, port=silent_server, connect_timeout_s=1)
    with pytest.raises(ConnectError) as info:
        _run(spec)
    assert str(info.value) == (f"[box] probe: 127.0.0.1:{silent_server} accepted the connection but sent "
                               "no SSH banner within 1 s (is it an SSH server? is sshd wedged?)")
    _no_raw_cause(info.value)
    deadline = time.monotonic() + 5  # paramiko's reader thread gives up on the banner in the background
    while any(isinstance(t, paramiko.Transport) for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert capfd.readouterr().err == ""


def test_unresolvable_jump_host_names_the_jump_field(ssh_spec_b):
    with pytest.raises(ConnectError) as info:
        _run(dataclasses.replace(ssh_spec_b, jump=JumpHost("bastion.invalid", 22, "root")))
    message = str(info.value)
    assert "ssh.jump" in message and "ssh.host" not in message, message
