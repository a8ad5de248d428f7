"""The README and the documentation site say what the code does.

- docs/reference/cli.md is what tools/gen_cli_docs.py writes from the commands' parsers (a flag
  added without regenerating the page fails here);
- `mkdocs build --strict` passes: no broken link or anchor, no page left out of the nav;
- the README's two set-up commands are the ones .ci/run runs;
- every code block marked runnable (an HTML comment line `<!-- runnable -->` right before its
  fence) in README.md and docs/ runs as written in a fresh empty directory and exits 0: bash
  blocks with `bash -e -o pipefail`, python blocks with `python3`; a `step N | ...` line shown
  in a text block right after one is in its output. A bash block's megapar commands each run
  in a fork of a process that has imported torch and the commands (tests/warm_commands.py),
  with the block's argv, environment, directory and output; a python block runs as `__main__`
  in a forked child of the test's process (tests/forked.py's run_python);
- a text block that starts with a megapar-plan command shows lines that command prints.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from repo_script import load_script

ROOT = Path(__file__).resolve().parents[1]
MARK = "<!-- runnable -->"
FENCE = re.compile(r"^```(\w*)\s*$")
RUNNERS = {"bash": ["bash", "-e", "-o", "pipefail"], "sh": ["bash", "-e", "-o", "pipefail"],
           "python": [sys.executable]}


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def code_blocks(path: Path) -> list[tuple[int, str, str, bool]]:
    """(line, language, text, marked runnable) of every fenced block with a language in `path`.
    A runnable mark that is not right before such a block is an error."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        marked = lines[i].strip() == MARK
        if marked:
            fence = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
            assert fence and fence.group(1), (f"{path.relative_to(ROOT)}:{i + 1}: {MARK} is "
                                              f"not right before a fenced code block")
            i += 1
        fence = FENCE.match(lines[i])
        if fence and fence.group(1):
            start, body = i + 1, []
            i += 1
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            blocks.append((start, fence.group(1), "\n".join(body) + "\n", marked))
        i += 1
    return blocks


STEP_LINE = re.compile(r"^step\s+\d+ \|")


def shown_step_lines(block, following) -> list[str]:
    """What a runnable block's output is shown to hold: the pieces (around `| ... |`) of each
    `step N | ...` line of a text block that starts within 10 lines after it."""
    if following is None or following[1] != "text":
        return []
    if following[0] - (block[0] + block[2].count("\n")) > 10:
        return []
    lines = [line for line in following[2].splitlines() if STEP_LINE.match(line)]
    return [piece for line in lines for piece in line.split(" | ... | ")]


def runnable_blocks() -> list:
    out = []
    for path in doc_files():
        blocks = code_blocks(path)
        for block, following in zip(blocks, [*blocks[1:], None]):
            line, lang, text, marked = block
            if marked:
                name = f"{path.relative_to(ROOT)}:{line}"
                assert lang in RUNNERS, f"{name}: a runnable block must be bash or python, " \
                                        f"not {lang!r}"
                out.append(pytest.param(lang, text, shown_step_lines(block, following), id=name))
    return out


RUNNABLE = runnable_blocks()


def test_every_use_in_the_readme_has_a_runnable_recipe():
    readme = [p for p in RUNNABLE if p.id.startswith("README.md:")]
    assert len(readme) >= 6, [p.id for p in readme]
    assert {p.values[0] for p in readme} == {"bash", "python"}


@pytest.fixture(scope="module")
def megapar_commands(tmp_path_factory):
    """A directory of megapar's commands, each started as a fork of one process that has
    imported what they import (tests/warm_commands.py): a runnable block's commands run as
    written, without 2-4 s of imports each."""
    from warm_commands import commands

    with commands(tmp_path_factory.mktemp("bin"), {**os.environ, "MEGAPAR_CPU": "1"}) as bin_:
        yield bin_


@pytest.mark.slow
@pytest.mark.parametrize("lang, text, shown", RUNNABLE)
def test_runnable_block_runs_as_written(lang, text, shown, tmp_path, request):
    """It exits 0, and the step lines the text right after it shows are in its output."""
    script = tmp_path / ("block.py" if lang == "python" else "block.sh")
    script.write_text(text)
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "MEGAPAR_CPU": "1"}
    if lang != "python":  # the commands' server only where a shell looks them up
        commands = request.getfixturevalue("megapar_commands")
        env["PATH"] = f"{commands}{os.pathsep}{os.environ.get('PATH', '')}"
    if lang == "python":  # a forked child of this process, torch imported (tests/forked.py)
        from forked import run_python

        code, stdout, stderr = run_python([script], env, 280, tmp_path, cwd=work)
    else:
        done = subprocess.run([*RUNNERS[lang], str(script)], cwd=work, env=env,
                              capture_output=True, text=True, timeout=280)
        code, stdout, stderr = done.returncode, done.stdout, done.stderr
    assert code == 0, (f"exit code {code}\n--- stdout\n{stdout[-3000:]}\n--- stderr\n"
                       f"{stderr[-3000:]}")
    printed = stdout + stderr
    for piece in shown:  # the doc shows what a run prints (moe.md's losses were stale)
        assert piece in printed, f"the doc shows {piece!r}; the run printed:\n{printed[-3000:]}"



def shown_plans() -> list:
    """Text blocks that show a megapar-plan command (its first lines, `\\` continuing them)
    and what it prints (the lines after)."""
    out = []
    for path in doc_files():
        for line, lang, text, _ in code_blocks(path):
            lines = text.strip("\n").splitlines()
            if lang != "text" or not lines[0].startswith("megapar-plan "):
                continue
            n = 1
            while lines[n - 1].endswith("\\"):
                n += 1
            command = " ".join(part.rstrip("\\").strip() for part in lines[:n])
            out.append(pytest.param(command, lines[n:], id=f"{path.relative_to(ROOT)}:{line}"))
    return out


@pytest.mark.parametrize("command, shown", shown_plans())
def test_a_shown_plan_is_what_megapar_plan_prints(command, shown, capsys):
    """Each line the doc shows under a megapar-plan command is a line the command prints
    (planner.md's mixtral-8x7b --explain showed a step of 26.0094 s with 0.2301 s of dp
    communication, from before ZeRO-1 stopped reducing the experts' buckets over a one-rank
    group; the plan says 25.8121 s and 0.0328 s)."""
    from megapar.cli.plan import main

    args = shlex.split(command)
    assert main(args[1:]) == 0
    printed = capsys.readouterr().out.splitlines()
    for line in shown:
        assert line in printed, f"the doc shows {line!r}; megapar-plan printed:\n" + \
            "\n".join(printed)

def _gen_cli_docs():
    return load_script("tools/gen_cli_docs.py")


def test_cli_reference_page_equals_the_parsers():
    gen = _gen_cli_docs()
    assert gen.PAGE.read_text() == gen.render(), (
        "docs/reference/cli.md differs from the commands' parsers: run "
        "`python tools/gen_cli_docs.py` and commit the page")


def test_cli_reference_covers_every_command_and_flag():
    gen = _gen_cli_docs()
    page = gen.PAGE.read_text()
    for name, module in gen.commands().items():
        assert f"## {name}\n" in page
        for action in gen.parser_of(module)._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            for option in action.option_strings:
                assert f"`{option}`" in page, f"{name} {option} is not on the page"


def test_the_setup_commands_are_the_ones_ci_runs():
    """The README's test command is .ci/run's pip and pytest lines (CI adds --quiet)."""
    readme = (ROOT / "README.md").read_text()
    run = [line.replace(" --quiet", "") for line in (ROOT / ".ci" / "run").read_text().splitlines()
           if line.startswith("python3 -m p")]
    assert " && ".join(run) in readme.splitlines()
    main = run[0] + " && " + run[1].replace('".[dev,fp8]"', ".") + " && megapar-train"
    assert main in readme.splitlines()


@pytest.mark.slow
def test_mkdocs_build_strict_passes(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(tmp_path / "site")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert (tmp_path / "site" / "reference" / "cli" / "index.html").exists()
    # every member api.md lists is on the page: mkdocstrings skips, without a warning, an
    # attribute documented only where a method other than __init__ sets it (six Engine ones)
    api = (ROOT / "docs" / "reference" / "api.md").read_text()
    page = (tmp_path / "site" / "reference" / "api" / "index.html").read_text()
    for obj, members in re.findall(r"^::: (\S+)\n    options:\n(?:      \S.*\n)*?      members:\n"
                                   r"((?:        - \S+\n)+)", api, re.M):
        for name in re.findall(r"- (\S+)", members):
            assert f'id="{obj}.{name}"' in page, f"api.md lists {obj}.{name}: not on the page"
    assert 'id="megapar.training.engine.Engine.source_dtype"' in page


def test_the_readmes_links_reach_files_and_headings():
    """README.md is outside the site: its links into docs/ are checked here (file and anchor)."""
    from markdown.extensions.toc import slugify

    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    assert any(link.startswith("docs/") for link in links)
    for link in links:
        if "://" in link:
            continue
        path, _, anchor = link.partition("#")
        target = ROOT / path if path else ROOT / "README.md"
        assert target.is_file(), f"README.md links to {link}: no such file"
        if anchor:
            headings = [slugify(h, "-") for h in
                        re.findall(r"^#+\s+(.*?)\s*$", target.read_text(), re.M)]
            assert anchor in headings, f"README.md links to {link}: no such heading"
