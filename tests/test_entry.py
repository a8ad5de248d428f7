"""The console scripts (pyproject.toml's [project.scripts]) run through `megapar.cli.entry`: a
Ctrl-C while a command imports (seconds: torch) or one its main does not handle ends it with
one line and exit 130, not a traceback of the import it cut."""

import importlib
import os
import subprocess
import sys
import tomllib

import pytest

from megapar.cli import entry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMANDS = ("train", "data", "eval", "convert", "bubble", "plan")


def test_every_console_script_runs_through_entry():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    assert scripts == {f"megapar-{c}": f"megapar.cli.entry:{c}" for c in COMMANDS}


@pytest.mark.parametrize("command", COMMANDS)
def test_entry_runs_the_command_s_main(monkeypatch, command):
    module = importlib.import_module(f"megapar.cli.{command}")
    monkeypatch.setattr(module, "main", lambda: 7)
    assert getattr(entry, command)() == 7


def test_ctrl_c_while_starting_or_unhandled_is_one_line_and_exit_130(monkeypatch, capsys):
    def interrupted(name):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(importlib, "import_module", interrupted)
        assert entry.train() == 130
    assert capsys.readouterr().err == (
        "megapar-train: interrupted while starting; nothing was done\n")

    def main():
        raise KeyboardInterrupt

    import megapar.cli.plan

    monkeypatch.setattr(megapar.cli.plan, "main", main)
    assert entry.plan() == 130
    assert capsys.readouterr().err == "megapar-plan: interrupted\n"


def test_the_entry_module_imports_no_torch():
    run = subprocess.run([sys.executable, "-c", "import sys, megapar.cli.entry; print("
                          "sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"],
                         capture_output=True, text=True, timeout=60, check=True)
    assert run.stdout.strip() == "[]", run.stdout
