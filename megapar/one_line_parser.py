"""`OneLineParser`: argparse with megapar's rule for bad input, for every command's parser.

It imports nothing but the standard library, so a command that answers `--help` and bad input
before importing torch (megapar-data, megapar-convert) can build its parser with it.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import shlex
import sys

_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")
"""A word argparse takes for a value, not a flag, where no flag looks like one (`-1`, `-.5`)."""


def shell_word(value: str | os.PathLike) -> str:
    """`value` (a path or other user-given value) as one word of a command line a message
    suggests, quoted where a shell would split or expand it (`out dir` -> `'out dir'`)."""
    return shlex.quote(os.fspath(value))


class OneLineParser(argparse.ArgumentParser):
    """argparse with megapar's rule for bad input: one line naming the problem and where the fix
    is (exit 2), not the whole usage; flags are never abbreviated (`--max-step` is not
    `--max-steps`), as in Megatron. A word no flag takes (`megapar-eval ck`) is named as
    unexpected, with where it belongs: `stray=(FLAG, WHAT)` names the flag a lone word most
    likely is the value of (`("--load", "the checkpoint")`: "pass the checkpoint as --load
    ck"), where the command line has not given that flag; else the flag before it that takes
    no more values; else that the command takes flags only. That comes before argparse's
    "arguments are required" (which would not name the word). Positionals of several words
    (megapar-convert's PATH...) may stand before, between and after the flags."""

    def __init__(self, *args, stray: tuple[str, str] | None = None, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.stray = stray

    def parse_args(self, args=None, namespace=None):
        argv = list(sys.argv[1:] if args is None else args)
        self._refuse_strays(argv)
        if self._spread_positionals():
            return self.parse_intermixed_args(argv, namespace)
        return super().parse_args(argv, namespace)

    def _spread_positionals(self) -> bool:
        """Whether a positional takes several words (then they may be split by flags)."""
        return any(not a.option_strings and a.nargs in ("*", "+") for a in self._actions)

    def _refuse_strays(self, argv: list[str]) -> None:
        """Exit 2 with one line where every word argparse leaves over is a lone value no flag
        takes (`megapar-eval ck`); parsed with the required flags held back, so that their
        absence does not hide the word. Unknown flags are left to argparse's own message."""
        held = [(a, a.required) for a in self._actions]
        try:
            for action, _ in held:
                action.required = False
            parse = (
                self.parse_known_intermixed_args
                if self._spread_positionals()
                else self.parse_known_args
            )
            _, extras = parse(argv, argparse.Namespace())
        finally:
            for action, required in held:
                action.required = required
        words = [w for w in extras if not w.startswith("-") or _NEGATIVE_NUMBER.match(w)]
        if not words or len(words) != len(extras):
            return
        named = ", ".join(f"'{w}'" for w in words)
        self.error(
            f"unexpected argument{'s' if len(words) > 1 else ''} {named}: "
            f"{self._stray_hint(argv, words)}"
        )

    def _stray_hint(self, argv: list[str], words: list[str]) -> str:
        """Where the first of `words` (left over from `argv`) belongs."""
        given = {w.split("=", 1)[0] for w in argv if w.startswith("-")}
        if self.stray and self.stray[0] not in given:
            flag, what = self.stray
            several = self._option_string_actions[flag].nargs in ("*", "+")
            values = words if several else words[:1]
            return f"pass {what} as {shlex.join([flag, *values])}"
        before = argv[: argv.index(words[0])]
        flags = [w for w in before if w.startswith("-") and not _NEGATIVE_NUMBER.match(w)]
        last = flags[-1].split("=", 1)[0] if flags else ""
        before_action = self._option_string_actions.get(last)
        if before_action is not None and before_action.nargs == 0:
            return f"{last} takes no value"
        if before_action is not None and before_action.nargs in (None, "?", 1):
            return f"{last} takes one value"
        return f"{self.prog} takes no positional arguments; give each value after its flag"

    def error(self, message: str):
        self.exit(
            2,
            f"{self.prog}: error: {message}{self._did_you_mean(message)} "
            f"(see {self.prog} --help)\n",
        )

    def _did_you_mean(self, message: str) -> str:
        """For unknown flags, the closest known one of each (`--max-step`: `--max-steps`);
        never `--help`, which is no flag's misspelling (`--ep` is as close to it as 0.6)."""
        prefix = "unrecognized arguments: "
        if not message.startswith(prefix):
            return ""
        known = sorted(o for o in self._option_string_actions if o.startswith("--"))
        known = [o for o in known if o != "--help"]
        hints = []
        for token in message[len(prefix) :].split():
            flag = token.split("=", 1)[0]
            close = difflib.get_close_matches(flag, known, n=1) if flag.startswith("--") else []
            if close:
                hints.append(f"{flag}: did you mean {close[0]}?")
        return "; " + "; ".join(hints) if hints else ""

    def given(self, argv: list[str] | None = None) -> tuple[str, ...]:
        """The dests a command line sets, whether or not to their default's value (`--steps 3`
        at default 3 is given), in the parser's order: for refusing an option the chosen mode
        would ignore. Parses `argv` (None: sys.argv[1:]) again with every default held back;
        call it after `parse_args` accepted the same argv."""
        held = [(a, a.default) for a in self._actions]
        parser_defaults, self._defaults = self._defaults, {}
        try:
            for action, _ in held:
                action.default = argparse.SUPPRESS
            seen = vars(self.parse_args(argv, argparse.Namespace()))
            return tuple(dict.fromkeys(a.dest for a in self._actions if a.dest in seen))
        finally:
            for action, default in held:
                action.default = default
            self._defaults = parser_defaults
