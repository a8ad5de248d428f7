"""The console scripts (pyproject.toml's [project.scripts]) run through `megapar.cli.entry`: a
Ctrl-C while a command imports (seconds: torch) or one its main does not handle ends it with
one line and exit 130, not a traceback of the import it cut."""

import importlib
import os
import signal
import subprocess
import sys
import tomllib

import pytest

from megapar.cli import entry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMANDS = ("train", "data", "eval", "convert", "bubble", "plan", "generate")


def test_every_console_script_runs_through_entry():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    assert scripts == {f"megapar-{c}": f"megapar.cli.entry:{c}" for c in COMMANDS}


@pytest.mark.parametrize("command", COMMANDS)
def test_entry_runs_the_command_s_main(monkeypatch, command):
    module = importlib.import_module(f"megapar.cli.{command}")
    monkeypatch.setattr(module, "main", lambda: 7)
    assert getattr(entry, command)() == 7


@pytest.mark.parametrize("sig,code,line", [
    ("SIGINT", 130, "megapar-data: interrupted while starting; nothing was done"),
    ("SIGTERM", 143, "megapar-data: terminated (SIGTERM) while starting; nothing was done"),
    # a closed terminal's SIGHUP, SIGQUIT, SIGUSR2: their default action ended it silently
    ("SIGHUP", 129, "megapar-data: hung up (SIGHUP) while starting; nothing was done"),
    ("SIGQUIT", 131, "megapar-data: quit (SIGQUIT) while starting; nothing was done"),
    ("SIGUSR2", 140, "megapar-data: ended (SIGUSR2) while starting; nothing was done")])
def test_ctrl_c_or_sigterm_while_starting_is_one_line(sig, code, line):
    """Ctrl-C: a traceback of the import it cut (23-28 lines); SIGTERM: a silent end. Now one
    line each, at once (an exception raised inside a library's import could be caught there:
    a SIGTERM at 0.5 s was, and the run went on)."""
    run = _starting(sig, "signal.default_int_handler")  # a terminal's foreground command
    assert (run.returncode, run.stderr, run.stdout) == (code, line + "\n", "")


def _starting(sig: str, sigint: str) -> subprocess.CompletedProcess:
    """megapar-data in a fresh process whose SIGINT handler is `sigint` and which receives
    `sig` while its command module imports (the import then gives a main returning 0)."""
    script = ("import importlib, os, signal, sys, time, types\n"
              f"signal.signal(signal.SIGINT, {sigint})\n"
              "from megapar.cli import entry\n"
              "def starting(name):\n"
              f"    os.kill(os.getpid(), signal.{sig}); time.sleep(1)\n"
              "    return types.SimpleNamespace(main=lambda: 0)\n"
              "importlib.import_module = starting\n"
              "sys.exit(entry.data())\n")
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)


def test_a_background_job_that_ignores_ctrl_c_goes_on_ignoring_it():
    """A shell starts a non-interactive `cmd &` with SIGINT ignored (and nohup-like runners
    keep it so): a Ctrl-C meant for the foreground is not this command's, so the entry leaves
    the ignore in place (it sets its one-line exit only over the default handler)."""
    run = _starting("SIGINT", "signal.SIG_IGN")
    assert (run.returncode, run.stderr, run.stdout) == (0, "", "")


def test_ctrl_c_the_command_does_not_handle_is_one_line_and_exit_130(monkeypatch, capsys):
    import megapar.cli.plan

    def main():
        raise KeyboardInterrupt

    monkeypatch.setattr(megapar.cli.plan, "main", main)
    before = signal.getsignal(signal.SIGINT)  # ignored when pytest runs as a background job
    assert entry.plan() == 130
    assert capsys.readouterr().err == "megapar-plan: interrupted\n"
    assert signal.getsignal(signal.SIGINT) is before  # the import's handler taken off


def test_a_ctrl_c_after_the_command_returned_is_ignored():
    """A second Ctrl-C just after megapar-train's clean stop (0.3 s after the first) came once
    the command had returned: its exit then printed the KeyboardInterrupt of a torch exit
    handler it cut, or died of the SIGINT (exit -2) after a complete save. The console script
    ignores one after its command returned; a caller that goes on (here: none named
    megapar-data) keeps its handler."""
    script = ("import os, signal, sys, time, types\n"
              "from megapar.cli import entry\n"
              "entry._import_main = lambda command, name: (lambda: 0)\n"
              "sys.argv[0] = sys.argv[1]\n"
              "code = entry.data()\n"
              "os.kill(os.getpid(), signal.SIGINT); time.sleep(0.2)\n"
              "print('exits', code)\n"
              "sys.exit(code)\n")
    for argv0 in ("/venv/bin/megapar-data", "notebook"):
        run = subprocess.run([sys.executable, "-c", script, argv0], capture_output=True,
                             text=True, timeout=60)
        if argv0 == "notebook":
            assert run.returncode == -signal.SIGINT and "KeyboardInterrupt" in run.stderr, run
        else:
            assert (run.returncode, run.stdout, run.stderr) == (0, "exits 0\n", ""), run


def test_the_entry_module_imports_no_torch():
    run = subprocess.run([sys.executable, "-c", "import sys, megapar.cli.entry; print("
                          "sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"],
                         capture_output=True, text=True, timeout=60, check=True)
    assert run.stdout.strip() == "[]", run.stdout

