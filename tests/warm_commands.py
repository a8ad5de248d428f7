"""megapar's console scripts, each run as its own process forked from one that has already
imported what the commands import (torch, torch._dynamo, megapar's command modules), for tests
that run the commands as a user types them (tests/test_docs.py's runnable blocks).

`commands(directory)` starts that process (the server) and writes, into `directory`, one
executable per name of pyproject.toml's `[project.scripts]`: put `directory` first on PATH and a
shell's `megapar-train ARGS` runs in a fork of the server with the caller's argv, environment,
working directory and standard input / output / error (passed over a Unix socket), through the
entry point pyproject.toml names, and exits with its exit status. A fresh command spends 2-4 s
of CPU importing before its first line of work; a fork of the server none.

What differs from the installed script: the imports happened before the command's argv and
environment were set (the server is started with the caller's environment, so torch read the same
variables), and in another working directory. Each module importing on its own is
tests/test_house.py's test; that the installed scripts run is the clean-clone run's (`.ci/run`
installs them and tests/test_docs.py's blocks beyond the commands still call them by name).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SERVER = r"""
import atexit, ctypes, gc, importlib, json, os, signal, socket, sys

# killed with the test process that started it, however that ends (Linux's PR_SET_PDEATHSIG,
# which its forks do not inherit)
if sys.platform.startswith("linux"):
    ctypes.CDLL(None).prctl(1, int(signal.SIGKILL), 0, 0, 0)
if os.getppid() != int(sys.argv[3]):
    sys.exit(1)

import torch  # noqa: F401  what every command imports
import torch._dynamo  # noqa: F401  what building torch's optimizers imports (megapar-train, -eval)

ENTRIES = json.loads(sys.argv[2])
for target in ENTRIES.values():
    importlib.import_module(target.split(":")[0])
for name in ENTRIES:
    importlib.import_module("megapar.cli." + name.removeprefix("megapar-"))
gc.freeze()  # a command's collections skip the server's objects, as megapar.launcher's workers do
listener = socket.socket(socket.AF_UNIX)
listener.bind(sys.argv[1])
listener.listen()
print("ready", flush=True)
while True:
    conn, _ = listener.accept()
    _, fds, _, _ = socket.recv_fds(conn, 1, 3)
    payload = b""
    while chunk := conn.recv(1 << 16):
        payload += chunk
    request = json.loads(payload)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the command: its own process, as if started as the installed script
        listener.close()
        conn.close()
        for target, fd in zip((0, 1, 2), fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = request["argv"]
        module, function = ENTRIES[request["name"]].split(":")
        try:
            code = getattr(sys.modules[module], function)()
        except SystemExit as exc:
            code = exc.code
        if code is not None and not isinstance(code, int):  # as the interpreter's exit does
            print(code, file=sys.stderr)
            code = 1
        # the interpreter's exit without its teardown of the server's modules (seconds of
        # copy-on-write faults in a fork); the command's own exit handlers run
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit((code or 0) & 0xFF)
    for fd in fds:
        os.close(fd)
    _, status = os.waitpid(pid, 0)
    conn.sendall(str(os.waitstatus_to_exitcode(status)).encode())
    conn.close()
"""

CLIENT = r"""#!{python} -I
import json, os, signal, socket, sys

conn = socket.socket(socket.AF_UNIX)
conn.connect({socket!r})
socket.send_fds(conn, [b"."], [0, 1, 2])
conn.sendall(json.dumps({{"name": {name!r}, "argv": sys.argv, "cwd": os.getcwd(),
                          "env": dict(os.environ)}}).encode())
conn.shutdown(socket.SHUT_WR)
answer = b""
while chunk := conn.recv(64):
    answer += chunk
code = int(answer or b"1")
if code < 0:  # ended by a signal: end this way too
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
sys.exit(code)
"""


def entry_points() -> dict[str, str]:
    """pyproject.toml's `[project.scripts]`: {command: "module:function"}."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["scripts"]


@contextmanager
def commands(directory: Path, env: dict[str, str]) -> Iterator[Path]:
    """Start the server with `env` and write the commands into `directory` (yielded); the
    server and any command still running are killed at the end."""
    import json

    directory.mkdir(parents=True, exist_ok=True)
    path = str(directory / "server.sock")
    entries = entry_points()
    server = subprocess.Popen([sys.executable, "-c", SERVER, path, json.dumps(entries),
                               str(os.getpid())],
                              env=env, cwd=directory, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, start_new_session=True)
    try:
        ready = server.stdout.readline()
        assert ready == b"ready\n", f"the commands' server did not start: {ready!r}"
        for name in entries:
            script = directory / name
            script.write_text(CLIENT.format(python=sys.executable, socket=path, name=name))
            script.chmod(0o755)
        yield directory
    finally:
        try:
            os.killpg(server.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        server.wait()
        server.stdout.close()
