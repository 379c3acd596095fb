"""The same contract on every transport: local bash, bash over real ssh, bash in a pct container.

Strings must arrive byte-exact, exit codes must propagate, the time limit must kill the command
ON THE TARGET, and put must replace files atomically with the requested mode.
"""
from __future__ import annotations

import hashlib
import shlex
import threading
import time

import pytest

from dflash_ops.errors import RemoteCommandError, RemoteTimeout
from dflash_ops.transport.factory import make_transport
from dflash_ops.transport.ssh import put_script

HOSTILE = [
    "plain",
    "",
    "two  spaces\tand a tab",
    " leading and trailing ",
    "single ' quote",
    'double " quote',
    "both '\" quotes \"'",
    "$(echo pwned)",
    "`echo pwned`",
    "${HOME} $HOME $0 $1 $@ $$",
    "new\nline",
    "trailing newline\n",
    "\r\ncrlf",
    "unicode ✓ ünïcödé 中文 🚀",
    "*", "?", "[a-z]*", "~", "~root",
    ";", "a; echo pwned", "a && b || c | d > e < f >> g 2>&1",
    "back\\slash", "\\", "\\\\n", "'", '"', "'\\''",
    "--", "-n", "-e \\n", "#not a comment", "!bang !!", "%s %d %%",
    "{a,b}", "$'\\x41'", "\x1b[31mescape\x1b[0m",
]
HOSTILE_NAME = "dir with 'quotes' \"and\" $(x) `y`/new\nline ✓;*.txt"


@pytest.fixture(params=["local", "ssh", "pct"])
def transport(request):
    target = request.getfixturevalue({"local": "local_target", "ssh": "ssh_target", "pct": "pct_target"}[request.param])
    t = make_transport(target)
    t.workdir = target.job.workdir  # where this test may write
    yield t
    t.close()


def test_hostile_strings_survive_as_arguments(transport):
    script = "\n".join(f"printf '%s\\0' {shlex.quote(s)}" for s in HOSTILE)
    result = transport.check(script)
    assert result.stdout.split("\0")[:-1] == HOSTILE


def test_hostile_script_text_reaches_bash_unchanged(transport):
    # The script itself carries every hostile string inside a here-document with a quoted
    # delimiter, so bash on the target must see exactly the bytes we sent.
    body = "\n".join(s.replace("\n", " ") for s in HOSTILE)
    result = transport.check(f"cat <<'END_OF_TEXT'\n{body}\nEND_OF_TEXT")
    assert result.stdout == body + "\n"


def test_hostile_strings_survive_as_stdin(transport):
    payload = "\0".join(HOSTILE).encode()
    assert transport.check("cat", stdin=payload).stdout == payload.decode()


def test_binary_stdin_arrives_byte_exact(transport):
    payload = bytes(range(256)) * 300 + "✓".encode()[:2]  # ends inside a UTF-8 character
    result = transport.check("sha256sum | cut -d' ' -f1", stdin=payload)
    assert result.stdout.strip() == hashlib.sha256(payload).hexdigest()


def test_stdin_is_closed_when_none_is_given(transport):
    # `cat` must see EOF at once rather than wait for input that never comes (cron, no tty).
    result = transport.run("cat; echo done", timeout=10)
    assert (result.exit_code, result.stdout) == (0, "done\n")


def test_large_multibyte_output_is_not_mangled(transport):
    # ~1.1 MB arrives in many reads; characters split across reads must still decode.
    result = transport.check("yes '€中🚀' | head -n 100000")
    assert result.stdout == "€中🚀\n" * 100000


@pytest.mark.parametrize("script,code", [("true", 0), ("false", 1), ("exit 42", 42),
                                         ("kill -TERM $$", 143), ("kill -KILL $$", 137),
                                         ("exit 124", 124)])
def test_exit_codes_propagate(transport, script, code):
    # 143/137 = 128 + SIGTERM/SIGKILL as a shell reports them; 124 and 137 that come quickly are
    # the script's own, not the time limit's.
    result = transport.run(script, timeout=30)
    assert result.exit_code == code
    assert result.ok == (code == 0)


def test_check_names_target_step_and_stderr(transport):
    with pytest.raises(RemoteCommandError) as info:
        transport.check("echo 'disk on fire' >&2; exit 3", step="inspect disk")
    text = str(info.value)
    assert transport.name in text and "inspect disk" in text and "exit code 3" in text and "disk on fire" in text


def _alive(transport, pids: list[str]) -> str:
    """The pids that still run on the target. A zombie is dead: it only waits for its parent
    (here the machine's pid 1, which may never reap it) to collect its exit status."""
    return transport.run("for p in " + " ".join(pids) + "; do s=$(cat /proc/$p/stat 2>/dev/null) || continue; "
                         "s=${s##*) }; [ \"${s%% *}\" != Z ] && echo $p; done").stdout


def test_time_limit_kills_the_command_on_the_target(transport):
    script = "sleep 300 & echo \"pids $$ $!\" >&2; wait"
    start = time.monotonic()
    with pytest.raises(RemoteTimeout) as info:
        transport.run(script, timeout=1, step="slow step")
    assert time.monotonic() - start < 5
    err = info.value
    assert (err.target, err.step) == (transport.name, "slow step")
    pids = err.stderr.split("pids ", 1)[1].split()
    assert len(pids) == 2
    # the script's shell and its background child are both gone on the target itself
    assert _alive(transport, pids) == ""
    assert _alive(transport, ["$$"]) != ""  # (the probe itself works: it sees its own pid)


def test_put_writes_exact_bytes_with_mode_at_a_hostile_path(transport):
    path = f"{transport.workdir}/{HOSTILE_NAME}"
    payload = bytes(range(256)) * 40 + "\0".join(HOSTILE).encode()
    transport.put(payload, path, mode=0o640)
    q = shlex.quote(path)
    out = transport.check(f"sha256sum < {q} | cut -d' ' -f1; stat -c %a -- {q}").stdout.split()
    assert out == [hashlib.sha256(payload).hexdigest(), "640"]
    transport.put(b"#!/bin/sh\necho run me\n", path, mode=0o755)
    assert transport.check(f"stat -c %a -- {q}; {q}").stdout == "755\nrun me\n"


def test_put_replaces_by_rename_and_leaves_no_temp_file(transport):
    directory = f"{transport.workdir}/atomic"
    path = f"{directory}/model.bin"
    q = shlex.quote(path)
    old, new = b"o" * 1_000_000, b"n" * 3_000_000
    transport.put(old, path)
    inode_before = transport.check(f"stat -c %i -- {q}").stdout.strip()

    # A reader on the target watches the file while the new content streams in: it must only
    # ever see the complete old or the complete new file, never a partial one.
    watch = transport.run  # same connection, second channel
    seen: dict = {}

    def watcher():
        seen["result"] = watch(f"for i in $(seq 2000); do s=$(stat -c %s -- {q}); echo $s; "
                               f"[ $s = {len(new)} ] && break; sleep 0.005; done", timeout=60)

    thread = threading.Thread(target=watcher)
    thread.start()
    time.sleep(0.2)
    transport.put(new, path)
    thread.join(60)
    sizes = set(seen["result"].stdout.split())
    assert sizes == {str(len(old)), str(len(new))}, sizes  # saw both, and nothing in between
    assert transport.check(f"stat -c %i -- {q}").stdout.strip() != inode_before  # a new file, renamed in
    assert transport.check(f"ls -A -- {shlex.quote(directory)}").stdout == "model.bin\n"


def test_put_refuses_a_short_transfer_and_keeps_the_old_file(transport):
    # What a connection lost mid-upload looks like to the target: EOF before all bytes arrived.
    path = f"{transport.workdir}/short/config.yaml"
    transport.put(b"good: 1\n", path)
    with pytest.raises(RemoteCommandError) as info:
        transport.check(put_script(path, 0o644, 100), stdin=b"truncated", step="put")
    assert "received 9 of 100 bytes" in str(info.value)
    q = shlex.quote(path)
    assert transport.check(f"cat -- {q}; ls -A -- {shlex.quote(transport.workdir + '/short')}").stdout == \
        "good: 1\nconfig.yaml\n"


def test_command_line_is_what_run_executes(transport):
    line = transport.command_line("echo 'hi there'", timeout=30)
    assert "timeout -k 5 30s bash -c" in line
    # the command line is a shell command that runs the script: feed it to a local shell
    # for local, or check its shape for remote ones (ssh host, pct exec with `--`)
    if transport.name == "local":
        import subprocess
        assert subprocess.run(["bash", "-c", line], capture_output=True, text=True).stdout == "hi there\n"
    else:
        argv = shlex.split(line)
        assert argv[0] == "ssh" and argv[-2] == "root@127.0.0.1"
        remote = shlex.split(argv[-1].removesuffix("; exit $?"))
        if transport.name.startswith("ct"):
            assert remote[:4] == ["pct", "exec", "200", "--"]
            remote = remote[4:]
        assert remote == ["timeout", "-k", "5", "30s", "bash", "-c", "echo 'hi there'"]
