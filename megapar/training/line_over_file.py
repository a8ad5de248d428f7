"""The command line's values set into another tool's config file before it is translated into
megapar-train's flags (`read_run_config`): the values the file derives from them (a warmup ratio
of the steps, a global batch of the micro-batch, a cosine's floor of the lr) are then the
line's, as the command line wins over a --config of megapar-train's own."""

from __future__ import annotations

from typing import Any

TRAINER_KEYS = {
    "--max-steps": ("max_steps",),
    "--micro-batch-size": ("per_device_train_batch_size",),
}
"""The Trainer's keys of megapar-train's flags whose values others derive from (a warmup ratio,
the global batch): the command line's stand in them before the file is translated."""

DEEPSPEED_KEYS = {
    "--max-steps": ("scheduler", "params", "total_num_steps"),
    "--warmup-steps": ("scheduler", "params", "warmup_num_steps"),
    "--micro-batch-size": ("train_micro_batch_size_per_gpu",),
}
"""DeepSpeed's, likewise (where the file has the key: its total steps cap the warmup, its
micro-batch makes the global batch; its warmup, cut to the total, was noted as the file's)."""


def at_the_line(
    data: dict, command_line: dict[str, str] | None, keys: dict, add: bool
) -> tuple[dict, list[str]]:
    """Another tool's settings `data` with the command line's values of `keys`' flags in its
    keys (a key the file lacks set only with `add`: a Trainer's max_steps where it counts
    epochs), and a note for each value it replaced: what the file's warmup ratio, global batch
    or warmup cap derive from (--max-steps 50 beside warmup_ratio 0.1 of max_steps 200 was
    said as --warmup-steps 20; a re-test)."""
    notes = []
    for flag, where in keys.items():
        text = (command_line or {}).get(flag)
        value = _number_of(text.split()[-1]) if text else None
        if value is None:
            continue
        before = get_in(data, where)
        data = _set_in(data, where, value, add)
        if before is not None and before != value:
            notes.append(f"the command line's {text} over the file's {'.'.join(where)} {before}")
    return data, notes


def get_in(tree: dict, where: tuple[str, ...]) -> Any:
    """The value at the path `where` of `tree`, or None."""
    value: Any = tree
    for key in where:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


def _set_in(tree: dict, where: tuple[str, ...], value: Any, add: bool) -> dict:
    """`tree` with its key at the path `where` set to `value` (copied, not changed in place);
    as it is where a section on the path is missing, or the key is and not `add`."""
    head, *rest = where
    if not rest:
        return {**tree, head: value} if add or head in tree else tree
    below = tree.get(head)
    if not isinstance(below, dict):
        return tree
    return {**tree, head: _set_in(below, tuple(rest), value, add)}


def _number_of(text: str) -> int | float | None:
    """`text` as a whole number, or a number, or None."""
    try:
        number = float(text)
    except ValueError:
        return None
    return int(number) if number.is_integer() else number


def named_at_the_line(command_line: dict[str, str] | None, flag: str, key: str) -> str:
    """What a value the file derives from is called where the command line's `flag` stands in
    its `key` (`at_the_line`): "the command line's --max-steps", else the file's `key` (a
    warmup was "more than max_steps 30" of the line's 30; a re-test)."""
    return f"the command line's {flag}" if flag in (command_line or {}) else key


def line_number(command_line: dict[str, str] | None, flag: str) -> int | float | None:
    """The command line's value of `flag` (its text: "--lr 0.001"), or None."""
    text = (command_line or {}).get(flag)
    return _number_of(text.split()[-1]) if text else None


def line_whole(command_line: dict[str, str] | None, flag: str) -> int | None:
    """The command line's whole-number value of `flag` (its text: "--dp 2"), or None."""
    value = line_number(command_line, flag)
    return value if isinstance(value, int) else None


def trainer_at_lr(data: dict, lr: float) -> dict:
    """The Trainer's arguments `data` at the command line's `lr`: its learning_rate, and its
    inline DeepSpeed optimizer's lr where that is a number (the Trainer requires the two alike;
    a cosine's floor is its ratio of it)."""
    data = {**data, "learning_rate": lr}
    inline = data.get("deepspeed")
    optimizer = inline.get("optimizer") if isinstance(inline, dict) else None
    if not isinstance(inline, dict) or not isinstance(optimizer, dict):
        return data
    params = optimizer.get("params")
    if isinstance(params, dict) and params.get("lr", "auto") != "auto":
        params = {**params, "lr": lr}
        data["deepspeed"] = {**inline, "optimizer": {**optimizer, "params": params}}
    return data
