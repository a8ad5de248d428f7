"""`OneLineParser`: argparse with megapar's rule for bad input, for every command's parser.

It imports nothing but the standard library, so a command that answers `--help` and bad input
before importing torch (megapar-data, megapar-convert) can build its parser with it.
"""

from __future__ import annotations

import argparse
import difflib
import os
import shlex


def shell_word(value: str | os.PathLike) -> str:
    """`value` (a path or other user-given value) as one word of a command line a message
    suggests, quoted where a shell would split or expand it (`out dir` -> `'out dir'`)."""
    return shlex.quote(os.fspath(value))


class OneLineParser(argparse.ArgumentParser):
    """argparse with megapar's rule for bad input: one line naming the problem and where the fix
    is (exit 2), not the whole usage; flags are never abbreviated (`--max-step` is not
    `--max-steps`), as in Megatron."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

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
