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
from collections.abc import Callable, Sequence

from megapar.wording import and_list

_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")
"""A word argparse takes for a value, not a flag, where no flag looks like one (`-1`, `-.5`)."""

TRUE_WORDS, FALSE_WORDS = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
"""The words (lower case) a switch's value may be given as: on, off (`--config` files,
`megapar-plan --explain` items, a value given to a switch on the command line)."""

OTHER_TRUE_WORDS, OTHER_FALSE_WORDS = TRUE_WORDS + ("t", "y"), FALSE_WORDS + ("f", "n")
"""The words another tool's switch may be given as on the command line: `TRUE_WORDS` /
`FALSE_WORDS` and the Hugging Face Trainer's t / y, f / n (its `string_to_bool`)."""

OFF_CHOICES = ("none", "off", "0")
"""The values that turn off a flag taking one of a list (`--recompute none`, `--fp8 off`,
`--zero 0`): what its --no- spelling, which is no flag, is told to give."""


def other_switch_value(text: str) -> bool | None:
    """`text` (another tool's switch's value: `False`, `n`, `0`) as true / false; None for a word
    that is neither."""
    word = text.lower()
    return True if word in OTHER_TRUE_WORDS else False if word in OTHER_FALSE_WORDS else None


MOST_GIB = 4096.0
"""The most memory a `gib_amount` takes for one GPU or rank (4 TiB): above it a figure is
another unit's (16000 for 16 GB is MB), not a device's."""

_SIZE = re.compile(r"^\s*([^\sa-zA-Z]+(?:[eE][-+]?\d+)?)\s*([a-zA-Z]*)\s*$")


def gib_amount(text) -> float:
    """A flag's memory size in GiB (--gpu-memory-gb): a number, optionally followed by GB, GiB
    or G (an "80 GB" GPU has 80 GiB, as the flag reads it); another unit (MB, TB), or above
    `MOST_GIB`, refused naming the unit the flag takes (argparse.ArgumentTypeError)."""
    match = _SIZE.match(str(text))
    unit = match.group(2).lower() if match else ""
    try:
        value = float(match.group(1)) if match and unit in ("", "g", "gb", "gib") else None
    except ValueError:
        value = None
    if value is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size in GiB: give a number of GiB, such as 80 for an 80 GB GPU"
        )
    if value > MOST_GIB:
        # a bare number this large is MB meant (16000 for a 16 GB GPU)
        in_mb = f" ({value:g} MB is {value / 1024:.3g} GiB)" if not unit and value < 2**20 else ""
        raise argparse.ArgumentTypeError(
            f"{value:g} GiB is more than any GPU holds: give a number of GiB, such as 80 for an "
            f"80 GB GPU{in_mb}"
        )
    return value


def shown_default(value) -> str:
    """A flag's default as its help and the reference show it: a switch's as on / off (not
    True / False), anything else as it is."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


SHARDING_CONFIG_NAMES = (
    "--fsdp",
    "--fsdp_config",
    "--fsdp-config",
    "--deepspeed",
    "--deepspeed_config",
    "--deepspeed-config",
)
"""FSDP's and DeepSpeed's switches and config files for sharding."""

SHARDING_NAMES = (
    *SHARDING_CONFIG_NAMES,
    "--stage",
    "--zero-stage",
    "--zero_stage",
    "--zero_optimization",
)
"""Other tools' names for sharding (FSDP's, DeepSpeed's), which a command answers as it answers
--zero (megapar-train with --zero, the others with what --zero means to them)."""

LAYOUT_NAMES = {
    "--tensor-model-parallel-size": "--tp",
    "--pipeline-model-parallel-size": "--pp",
    "--context-parallel-size": "--cp",
    "--expert-model-parallel-size": "--ep",
    "--data-parallel-size": "--dp",  # Megatron infers it; those who spell it mean --dp
    "--parallelism.tensor_parallel_degree": "--tp",
    "--parallelism.pipeline_parallel_degree": "--pp",
    "--parallelism.context_parallel_degree": "--cp",
    "--parallelism.expert_parallel_degree": "--ep",
    "--parallelism.data_parallel_shard_degree": "--dp",
    "--parallelism.data_parallel_replicate_degree": "--dp",
    "--tensor-parallel-degree": "--tp",  # torchtitan's, without their section
    "--pipeline-parallel-degree": "--pp",
    "--context-parallel-degree": "--cp",
    "--expert-parallel-degree": "--ep",
    "--data-parallel-shard-degree": "--dp",
    "--data-parallel-replicate-degree": "--dp",
    "--virtual-pipeline-model-parallel-size": "--virtual-stages",
    "--num-layers-per-virtual-pipeline-stage": "--virtual-stages",
    "--num-virtual-stages-per-pipeline-rank": "--virtual-stages",  # Megatron-LM's newer name
    "--tensor-parallel-size": "--tp",  # vLLM's and DeepSpeed-inference's
    "--tensor-parallel": "--tp",  # a --config key's spelling (tensor_parallel: 2)
    "--pipeline-parallel": "--pp",
    "--context-parallel": "--cp",
    "--expert-parallel": "--ep",
    "--data-parallel": "--dp",
    "--pipeline-parallel-size": "--pp",
    "--tp-size": "--tp",  # SGLang's
    "--pp-size": "--pp",
    "--dp-size": "--dp",
    "--ep-size": "--ep",
}
"""Megatron-LM's, torchtitan's, vLLM's and SGLang's names for the parallel sizes (and the model
chunks per pipeline rank), with megapar's flag for each."""


_TOKENIZER_FILES = (
    "--tokenizer DIR (a directory holding the vocabulary's files as vocab.json and merges.txt, "
    "or a tokenizer.json; the GPT-2 tokenizer is --tokenizer gpt2)"
)
TOKENIZER_NAMES = {
    "--vocab-file": _TOKENIZER_FILES,
    "--merge-file": _TOKENIZER_FILES,
    "--tokenizer-type": "--tokenizer (GPT2BPETokenizer: --tokenizer gpt2; "
    "HuggingFaceTokenizer: --tokenizer DIR of its tokenizer.json; SentencePieceTokenizer: "
    "--tokenizer FILE.model)",
    "--tokenizer-model": "--tokenizer (a SentencePiece .model file, or a transformers directory)",
}
"""Megatron-LM's tokenizer flags, with what megapar-train's and megapar-data's --tokenizer take
for each (one table for both CLIs)."""


LAYOUT_NOTES = {
    "--num-layers-per-virtual-pipeline-stage": " (model chunks per rank: the layers over pp x "
    "the layers of a chunk)",
}
"""What a user of `LAYOUT_NAMES`' name must know to give megapar's flag its value, where the two
count different things."""


def layout_names(*flags: str) -> dict[str, str]:
    """`LAYOUT_NAMES`'s entries for the parallel sizes a tool takes (`"--tp", "--pp"`): each CLI
    answers the other tools' names for its own sizes from this one table."""
    return {
        theirs: ours + LAYOUT_NOTES.get(theirs, "")
        for theirs, ours in LAYOUT_NAMES.items()
        if ours in flags
    }


def shell_word(value: str | os.PathLike) -> str:
    """`value` (a path or other user-given value) as one word of a command line a message
    suggests, quoted where a shell would split or expand it (`out dir` -> `'out dir'`)."""
    return shlex.quote(os.fspath(value))


def key_without_section(known_as: dict[str, str], flag: str) -> str | None:
    """The dotted key of `known_as` (`--training.max_norm`) that `flag` (`--max_norm`,
    `--max-norm`) is the last part of, where every such key has the same answer; None
    otherwise (`--enabled` ends both fp16's and bf16's)."""
    tail = flag[2:].replace("-", "_")
    keys = [k for k in known_as if "." in k and k.rpartition(".")[2] == tail]
    return keys[0] if keys and len({known_as[k] for k in keys}) == 1 else None


class OneLineParser(argparse.ArgumentParser):
    """argparse with megapar's rule for bad input: one line naming the problem and where the fix
    is (exit 2), not the whole usage; flags are never abbreviated (`--max-step` is not
    `--max-steps`), as in Megatron. Words argparse cannot place come before its "arguments are
    required" (which would name neither them nor a misspelt required flag): an unknown flag is
    named with the closest known one (`--lod: did you mean --load?`); a word no flag takes
    (`megapar-eval ck`) as unexpected, with where it belongs: `stray`, ((FLAG, WHAT), ...),
    names the flags lone words most likely are the values of, in order (`(("--load", "the
    checkpoint"),)`: "pass the checkpoint as --load ck"), among those the command line has not
    given; else the flag before the word, which takes no more values; else that the command
    takes flags only. Positionals of several words (megapar-convert's PATH...) may stand
    before, between and after the flags. A value a flag's choices lack is named as its
    `value_known_as[flag]` function says (another tool's name for a choice), where it knows it.
    Megatron's and torchtitan's names for a parallel size the command does not take (those
    `known_as` answers by megapar's flag: `--ep` to megapar-eval) get that answer too.
    `switch_known_as(flag, value)` answers another tool's switch given a value
    (`--decay_lr=False`, `--bf16 0`: the value's word) where it changes the `known_as` answer
    (None where it does not, or the value is no switch's: `--loss_scale 0`). An unknown flag
    close to one of the command's switches given false (`--sequence_parallel=False`) is told
    the switch's off (`switch_defaults`: each switch's default where the parser's own is None,
    megapar-train's read from its settings). `afterword(unknown, given)`, given the unknown
    flags and every flag of the line, says what the line should add once after their answers
    ("" for nothing): megapar-train's names the defaults it does not share with the tool the
    flags come from."""

    def __init__(
        self,
        *args,
        stray: tuple[tuple[str, str], ...] = (),
        known_as: dict[str, str] | None = None,
        value_known_as: dict[str, Callable[[str], str]] | None = None,
        switch_known_as: Callable[[str, str], str | None] | None = None,
        switch_defaults: dict[str, bool | None] | None = None,
        off_values: dict[str, str] | None = None,
        afterword: Callable[[list[str], set[str]], str] | None = None,
        **kwargs,
    ):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)
        self.stray = stray
        self.known_as = dict(known_as or {})
        for theirs, ours in LAYOUT_NAMES.items():  # a size it does not take: its own answer
            if theirs not in self.known_as and ours in self.known_as:
                self.known_as[theirs] = self.known_as[ours]
        self.value_known_as = value_known_as or {}
        self.switch_known_as = switch_known_as
        self.switch_defaults = switch_defaults or {}
        self.off_values = off_values or {}
        self.afterword = afterword
        self._given_flags: set[str] = set()
        self._also_missing = ""  # the required flags not given beside unknown ones

    def parse_args(self, args=None, namespace=None):
        argv = list(sys.argv[1:] if args is None else args)
        self._given_flags = {w.split("=", 1)[0] for w in argv if w.startswith("--")}
        self._given_values = {  # a flag given a value in its word: --no-compile=true
            w.split("=", 1)[0] for w in argv if w.startswith("--") and "=" in w
        }
        self._refuse_unplaced(argv)
        if self._spread_positionals():
            return self.parse_intermixed_args(argv, namespace)
        return super().parse_args(argv, namespace)

    def _spread_positionals(self) -> bool:
        """Whether a positional takes several words (then they may be split by flags)."""
        return any(not a.option_strings and a.nargs in ("*", "+") for a in self._actions)

    def _refuse_unplaced(self, argv: list[str]) -> None:
        """Exit 2 with one line naming the words argparse leaves over (unknown flags, or values
        no flag takes); parsed with the required flags held back, so that the absence of one
        does not hide them."""
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
        if not extras:
            return
        if len(words) != len(extras):  # an unknown flag: its value is among the words
            shown = _with_values(argv, extras) if self._spread_positionals() else extras
            missing = [  # said with them (megapar-plan --bf16 0 then wanted --seq-len)
                a.option_strings[0]
                for a, required in held
                if required and a.option_strings and not self._given_flags & set(a.option_strings)
            ]
            self._also_missing = (
                f"; and {and_list(missing)} {'is' if len(missing) == 1 else 'are'} required"
                if missing
                else ""
            )
            self.error(f"unrecognized arguments: {' '.join(shown)}")
        named = ", ".join(f"'{w}'" for w in words)
        self.error(
            f"unexpected argument{'s' if len(words) > 1 else ''} {named}: "
            f"{self._stray_hint(argv, words)}"
        )

    def _stray_hint(self, argv: list[str], words: list[str]) -> str:
        """Where `words` (left over from `argv`, none of them a flag) belong."""
        given = {w.split("=", 1)[0] for w in argv if w.startswith("-")}
        missing = [(flag, what) for flag, what in self.stray if flag not in given]
        if missing:
            return self._as_flags(missing[: len(words)], words)
        before = argv[: argv.index(words[0])]
        flags = [w for w in before if w.startswith("-") and not _NEGATIVE_NUMBER.match(w)]
        last = flags[-1].split("=", 1)[0] if flags else ""
        before_action = self._option_string_actions.get(last)
        if before_action is not None and before_action.nargs == 0:
            switch = other_switch_value(words[0]) if len(words) == 1 else None
            no = f"--no-{last[2:]}" if not last.startswith("--no-") else ""
            if switch is True:  # `--tf32 False`, as Hugging Face's parser spells it
                return f"{last} takes no value: give {last} alone"
            if switch is False and no in before_action.option_strings:
                return f"{last} takes no value: for false give {no}"
            if switch is False:
                return f"{last} takes no value: for false leave it out"
            return f"{last} takes no value"
        if before_action is not None and before_action.nargs in (None, "?", 1):
            return f"{last} takes one value"
        return f"{self.prog} takes no positional arguments; give each value after its flag"

    def _as_flags(self, flags: list[tuple[str, str]], words: list[str]) -> str:
        """`words` given as `flags` (no more of them than words): the last flags one word
        each, from the end; the first the words before those (all, where it takes several)."""
        tail = len(flags) - 1
        head = words[: len(words) - tail]
        if self._option_string_actions[flags[0][0]].nargs not in ("*", "+"):
            head = head[:1]
        parts = [flags[0][0], *head]
        for (flag, _), word in zip(flags[1:], words[len(words) - tail :]):
            parts += [flag, word]
        return f"pass {and_list([what for _, what in flags])} as {shlex.join(parts)}"

    def error(self, message: str):
        message = self._switch_given_a_value(message) or message
        self.exit(
            2,
            f"{self.prog}: error: {message}{self._did_you_mean(message)}"
            f"{self._value_wanted(message)}"
            f"{self._value_named_elsewhere(message) or self._closest_choice(message)}"
            f"{self._also_missing} (see {self.prog} --help)\n",
        )

    def _switch_given_a_value(self, message: str) -> str:
        """For a value given to a flag that takes none (`--account-for-embedding-in-pipeline-
        split=1`, which argparse answers "ignored explicit argument '1'"), the line naming the
        switch and how to say what the value meant: the flag alone for on (1, true, yes),
        its --no- spelling, or leaving it out, for off; "" for any other message."""
        match = re.fullmatch(r"argument (\S+): ignored explicit argument '(.*)'", message)
        if match is None:
            return ""
        spellings = [name for name in match.group(1).split("/") if name.startswith("--")]
        on = next((name for name in spellings if not name.startswith("--no-")), None)
        if on is None:
            return ""
        off_name = f"--no-{on[2:]}"
        off = f"give {off_name}" if off_name in spellings else "leave it out"
        value = match.group(2)
        given: set[str] = getattr(self, "_given_values", set())
        said = on  # --no-compile=true is off: its true and false are the other way round (it
        if off_name in given and on not in given:  # was told "give --compile alone"; beside
            # --compile too: the spelling given the value decides; re-tests)
            said, value_means_on = off_name, value.lower() in FALSE_WORDS
        else:
            value_means_on = value.lower() in TRUE_WORDS
        if value.lower() in TRUE_WORDS + FALSE_WORDS:
            fix = f"give {on} alone" if value_means_on else off
        else:
            fix = f"give {on} alone to turn it on; to turn it off, {off}"
        return f"{said} is a switch and takes no value (={value} given); {fix}"

    def _value_named_elsewhere(self, message: str) -> str:
        """For a value a flag's choices (or its type) lack, another tool's name for one of
        them, as the flag's `value_known_as` entry says (`--schedule ScheduleInterleaved1F1B`:
        "is megapar's --schedule interleaved --virtual-stages V"; `--loss-scale dynamic`);
        "" otherwise."""
        match = re.fullmatch(
            r"argument (\S+): invalid (?:choice: (.+?) \(choose from .*\)|\w+ value: (.+))", message
        )
        if match is None:
            return ""
        name = self.value_known_as.get(_long_spelling(match.group(1)))
        if name is None:
            return ""
        value = match.group(2) if match.group(2) is not None else match.group(3)
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
            value = value[1:-1]
        said = name(value)
        return f"; {said}" if said else ""

    def _closest_choice(self, message: str) -> str:
        """For a value a flag's choices lack, the closest of them (`--attention-mask-type
        block-causal`: "did you mean block_causal?"); "" when none is close."""
        match = re.fullmatch(r"argument (\S+): invalid choice: '(.+?)' \(choose from .*\)", message)
        if match is None:
            return ""
        action = self._option_string_actions.get(_long_spelling(match.group(1)))
        if action is None or not action.choices:
            return ""
        choices = [str(c) for c in action.choices]
        close = difflib.get_close_matches(match.group(2), choices, n=1)
        if not close:
            close = difflib.get_close_matches(match.group(2).lower(), choices, n=1)
        return f"; did you mean {close[0]}?" if close else ""

    def _value_wanted(self, message: str) -> str:
        """For a flag given without its value (`--recompute` at the end of the line, or before
        another flag), what the value is: its choices (`--recompute none|selective|full`) or
        its placeholder (`--to-hf TO_HF`), so the line shows the fix, not only the problem."""
        match = re.fullmatch(r"argument (\S+): expected (?:one|at least one) argument", message)
        if match is None:
            return ""
        flag = _long_spelling(match.group(1))
        action = self._option_string_actions.get(flag)
        if action is None:
            return ""
        if action.choices:
            return f"; give it one of its values: {flag} {'|'.join(map(str, action.choices))}"
        metavar = action.metavar or action.dest.upper()
        shown = metavar if isinstance(metavar, str) else " ".join(metavar)
        return f"; give its value: {flag} {shown}"

    @staticmethod
    def _value_given(token: str, after: list[str]) -> str | None:
        """The value an unknown flag is given (`--decay_lr=False`, or the word after it,
        `--decay_lr no`, where that is no flag); None for none."""
        if "=" in token:
            return token.split("=", 1)[1]
        return after[0] if after and not after[0].startswith("--") else None

    def _negated_switch(self, flag: str) -> str | None:
        """For another tool's switch given as its --no- spelling (`--no-decay-lr`,
        `--no-gradient-checkpointing`), `switch_known_as`'s answer to its false; None where it
        has none (or `flag` is no such spelling)."""
        if not flag.startswith(("--no-", "--no_")) or self.switch_known_as is None:
            return None
        on = "--" + flag[len("--no-") :]
        named = on if on in self.known_as else on.replace("_", "-")
        if named not in self.known_as:
            named = on.replace("-", "_") if on.replace("-", "_") in self.known_as else named
        return self.switch_known_as(named, "false") if named in self.known_as else None

    def _negated_option(self, flag: str) -> str | None:
        """For `--no-NAME` where `--NAME` takes a value: the value that turns it off, where
        `off_values` names one (`--no-clip-grad`: "did you mean --clip-grad 0?") or its list
        of values holds one (`--no-recompute`: --recompute none); where `off_values` gives ""
        (a flag off unless given: `--no-save`), to leave it out; for another, that it takes a
        value (`--no-label-smoothing` was "did you mean --label-smoothing?", which then wanted
        one). None where `flag` is no such spelling (`--no-fp8` was guessed close to
        `--no-fp8-emulate`, another switch, and `--no-save` to `--save`, which it is not)."""
        if not flag.startswith(("--no-", "--no_")):
            return None
        on = "--" + flag[len("--no-") :].replace("_", "-")
        action = self._option_string_actions.get(on)
        if action is None or action.nargs == 0:
            return None
        if on in self.off_values:
            off = self.off_values[on]
            return f"did you mean {on} {off}?" if off else f"{on} is off unless given: leave it out"
        choices = action.choices or ()
        offs = [c for c in choices if str(c) in OFF_CHOICES]
        if offs:
            return f"did you mean {on} {offs[0]}?"
        return f"{on} takes a value (no --no- spelling): leave it out for its default, or give one"

    def _switch_off(self, flag: str, value: str) -> str:
        """For an unknown flag given `value` whose closest known flag is the switch `flag`
        (`--sequence_parallel=False`: `--sequence-parallel`), where `value` is false: how to
        say off (its --no- spelling, or leaving it out); "" otherwise (on is the switch itself,
        as the guess says)."""
        action = self._option_string_actions.get(flag)
        if action is None or action.nargs != 0 or other_switch_value(value) is not False:
            return ""
        default = self.switch_defaults.get(flag, action.default)
        if default is not False:  # on, or chosen by the run (None): its --no- spelling
            no = f"--no-{flag[2:]}"
            return f"did you mean {no}?" if no in action.option_strings else ""
        return f"false leaves {flag} off, as it is by default: leave the flag out"

    def _did_you_mean(self, message: str) -> str:
        """For unknown flags, the closest known one of each (`--max-step`: `--max-steps`);
        never `--help`, which is no flag's misspelling (`--ep` is as close to it as 0.6). Another
        tool's name for a flag (`known_as`: `--resume` -> `--load`) is named as such, not
        spelt close to an unrelated flag (`--resume`: `--recompute`); a `known_as` entry that is
        not a flag is said as it is (what to do instead: `--cp` to megapar-eval, which has no
        context parallelism), and an empty one suppresses the guess (`--no-load-optim` is not
        `--no-offload-optimizer`). An underscored name (`--grad_clip`) is looked up dashed too; one
        that begins one known flag only is that flag cut short (`--out`: `--output-prefix`, not
        the closer spelt `--input`). A dotted key of a section another tool's flag names
        (`--zero_optimization.sub_group_size`) gets that section's answer, and a key given
        without its section (`--max_norm`, torchtitan's `training.max_norm`) the answer of the
        one dotted key it ends (`key_without_section`). A sentence that
        answers several of the flags given is said once, after all of them."""
        prefix = "unrecognized arguments: "
        if not message.startswith(prefix):
            return ""
        known = sorted(o for o in self._option_string_actions if o.startswith("--"))
        known = [o for o in known if o != "--help"]
        hints = []
        said_for: dict[str, list[str]] = {}  # a sentence answering several flags: said once
        tokens = message[len(prefix) :].split()
        for at, token in enumerate(tokens):
            flag = token.split("=", 1)[0]
            named = flag if flag in self.known_as else flag.replace("_", "-")  # nanoGPT's --a_b
            if named not in self.known_as and "." in flag:  # DeepSpeed's --zero-optimization.x
                head, _, rest = flag.partition(".")
                section = "--" + head[2:].replace("-", "_")
                named = f"{section}.{rest}"
                if named not in self.known_as:  # a key of a section it answers
                    named = section if section in self.known_as else section.replace("_", "-")
            if named not in self.known_as and "." not in flag:  # torchtitan's --max_norm
                named = key_without_section(self.known_as, flag) or named
            if named in self.known_as:
                ours = self.known_as[named]
                value = self._value_given(token, tokens[at + 1 : at + 2])
                answer = self.switch_known_as
                said = answer(named, value) if answer and value is not None else None
                if said:  # --decay_lr=False: not --lr-decay cosine
                    hints.append(f"{token}: {said}")
                elif ours.startswith("--"):
                    hints.append(f"{flag}: did you mean {ours}?")
                elif ours:
                    said_for.setdefault(ours, []).append(flag)
                    hints.append(ours)  # said once, after every flag it answers (below)
                continue
            if said := self._negated_switch(flag) or self._negated_option(flag):
                hints.append(f"{flag}: {said}")  # --no-decay-lr: not --no-dry-run
                continue
            close = _close_flag(flag, known)
            longer = [o for o in known if o.startswith(flag)] if flag.startswith("--") else []
            theirs = {  # another tool's flag cut short: `--checkp` is `--checkpoint` (`--load`)
                self.known_as[k]
                for k in self.known_as
                if flag.startswith("--") and k.startswith(flag) and self.known_as[k][:2] == "--"
            }
            if not longer and len(theirs) == 1:
                longer = list(theirs)
            if len(longer) == 1:  # cut short (no abbreviations): `--out` is `--output-prefix`
                close = longer
            if close and close[0].startswith("--no-") and not flag.startswith("--no"):
                on = "--" + close[0][len("--no-") :]  # `--torch-compile`: --compile, not
                close = [on] if on in known else close  # its --no-compile
            value = self._value_given(token, tokens[at + 1 : at + 2])
            off = self._switch_off(close[0], value) if close and value is not None else ""
            if off:
                hints.append(f"{token}: {off}")
            elif close:
                hints.append(f"{flag}: did you mean {close[0]}?")
        flags = [t.split("=", 1)[0] for t in message[len(prefix) :].split() if t[:2] == "--"]
        said = self.afterword(flags, self._given_flags) if self.afterword is not None else ""
        if said:
            hints.append(said)
        hints = [
            f"{', '.join(dict.fromkeys(said_for[h]))}: {h}" if h in said_for else h
            for h in dict.fromkeys(hints)  # a flag given twice is answered once
        ]
        return "; " + "; ".join(hints) if hints else ""

    @property
    def given_flags(self) -> frozenset[str]:
        """The flags the command line being parsed gives (`--x=1` as `--x`), for an answer to
        another tool's flag that depends on them (megapar-plan's `--gpu 2` beside `--gpus`)."""
        return frozenset(self._given_flags)

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


def _close_flag(flag: str, known: Sequence[str]) -> list[str]:
    """The known flag closest to `flag` by name ([] for none, or for no ``--`` flag): compared
    without their shared ``--``, which made any two short flags close (``--wd`` was ``--dp``);
    a ``--no-`` flag only with a switch's ``--no-`` spelling, by what follows it (a typo:
    ``--no-compil``), at a closeness of 0.8 (``--no-fp32`` is no ``--no-tf32``, at 0.75)."""
    if not flag.startswith("--"):
        return []
    if flag.startswith(("--no-", "--no_")):  # a switch's off, by what follows the "no-" alone:
        off = {k[5:]: k for k in known if k.startswith("--no-")}  # the shared "no-" made
        stem = flag[5:].replace("_", "-")  # --no-dropout close to --no-dry-run, a real run
        return [off[c] for c in difflib.get_close_matches(stem, list(off), n=1, cutoff=0.8)]
    names = {k[2:]: k for k in known if k.startswith("--")}
    return [names[c] for c in difflib.get_close_matches(flag[2:], list(names), n=1)]


def _with_values(argv: list[str], extras: list[str]) -> list[str]:
    """For an intermixed parse (positionals of several words, megapar-convert's PATH...): the
    unknown flags among `extras` (the words it left over from `argv`), each as it was given:
    with the word after it in `argv` where that is no flag (its value, whether the parse left it
    over or took it for a PATH). The other words left over are not shown: they are paths the
    parse did not place after an unknown flag (`a --foo 2 b` leaves `--foo 2 b` over; the line
    shows `--foo 2`)."""
    unknown = {w for w in extras if w.startswith("-") and not _NEGATIVE_NUMBER.match(w)}
    shown = []
    for i, word in enumerate(argv):
        if word not in unknown:
            continue
        shown.append(word)
        after = argv[i + 1] if i + 1 < len(argv) else None
        takes_next = "=" not in word
        if (
            takes_next
            and after is not None
            and (not after.startswith("-") or _NEGATIVE_NUMBER.match(after))
        ):
            shown.append(after)
    return shown


def show_progress(progress: bool | None) -> bool:
    """Whether a command draws its progress bar: as --progress / --no-progress say, or, where
    neither is given (None), only when stderr is a terminal: in a log file (a redirect, a pipe,
    a batch job's output) a bar is carriage returns mixed into the log lines."""
    if progress is not None:
        return progress
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty is not None and isatty())


def _long_spelling(spellings: str) -> str:
    """The flag argparse's message names as "-p/--pp": its long spelling (else the first)."""
    names = spellings.split("/")
    return next((name for name in names if name.startswith("--")), names[0])
