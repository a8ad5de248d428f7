"""megapar-bubble's sizes and costs checked, and a schedule small enough to simulate, with the
standard library and the pipeline's pure-Python schedules only: a simulation from given costs
is refused or run before torch is imported. Where megapar-bubble builds a model, its flags are
checked next by `validate_tools.check_bubble_measurement`.

Raises usage.UsageError (exit code 2) before any model is built or process started.
"""

from __future__ import annotations

import math
import sys

from megapar.pipeline.placement import chunks_per_rank
from megapar.pipeline.schedules import SPLIT_BACKWARD
from megapar.pipeline.simulate import Costs, theoretical_bubble
from megapar.training.usage import UsageError, flag_of

MAX_SIMULATED_ACTIONS = 50_000
"""--simulate / --show-schedule refuse schedules with more actions than this (forwards and
backwards of every stage, chunk and micro-batch; the simulator is pure Python, its time at
this size in docs/guides/bubble.md)."""
MAX_SIMULATED_STAGES = 256
"""--simulate refuses more stages than this (its cost also grows with the square of pp)."""


def check_bubble_args(args) -> None:
    """Every size >= 1, every cost a finite number of milliseconds, B and W that split the
    backward (`check_split_costs`), and a schedule of at most
    `MAX_SIMULATED_ACTIONS` actions (`MAX_SIMULATED_STAGES` stages under --simulate); an
    oversized request is told the schedule's published bubble instead."""
    for name in (
        "pp",
        "microbatches",
        "tp",
        "cp",
        "steps",
        "micro_batch_size",
        "seq_len",
        "virtual_stages",
    ):
        value = getattr(args, name)
        if value < 1:
            raise UsageError(f"{flag_of(name)} {value} is invalid: it must be >= 1")
    for name in ("fwd_ms", "bwd_ms", "p2p_ms", "bwd_input_ms", "bwd_weight_ms"):
        value = getattr(args, name)
        positive = name in ("fwd_ms", "bwd_ms")  # a split backward part may cost nothing
        if value is not None and not (
            math.isfinite(value) and value >= (1e-300 if positive else 0.0)
        ):
            need = "> 0" if positive else ">= 0"
            raise UsageError(
                f"{flag_of(name)} {value} is invalid: a cost must be a finite "
                f"number of milliseconds {need}"
            )
    check_split_costs(args)  # before the size: an oversized request is told the costs' bubble
    try:  # zb-v and dualpipev hold 2 chunks per rank whether --virtual-stages says 1 or 2
        chunks = chunks_per_rank(args.schedule, args.virtual_stages)
    except ValueError:  # refused with its own words by check_schedule
        chunks = max(1, args.virtual_stages)
    actions = 2 * args.pp * args.microbatches * chunks
    if args.fwd_ms is not None:
        _check_step_is_finite(args, chunks)
    if actions > MAX_SIMULATED_ACTIONS or args.simulate and args.pp > MAX_SIMULATED_STAGES:
        v = ""  # one chunk per rank: nothing to multiply by
        if chunks > 1:
            v = (
                f" x --virtual-stages {args.virtual_stages}"
                if chunks == args.virtual_stages
                else f" x {chunks} model chunks per rank"
            )
        many = actions > MAX_SIMULATED_ACTIONS
        stages = args.simulate and args.pp > MAX_SIMULATED_STAGES
        what, limit = (
            (
                "actions and stages",
                f"{MAX_SIMULATED_ACTIONS:,} actions, {MAX_SIMULATED_STAGES} stages",
            )
            if many and stages
            else ("actions", f"{MAX_SIMULATED_ACTIONS:,}")
            if many
            else ("stages", f"{MAX_SIMULATED_STAGES}")
        )
        does = "simulates" if stages else "measures or simulates"
        raise UsageError(
            f"--pp {args.pp} x --microbatches {args.microbatches}{v} is "
            f"{actions:,} actions on {args.pp} stages, more {what} than megapar-bubble {does} "
            f"in seconds ({limit}); {_formula_instead(args)}"
        )


def check_split_costs(args) -> None:
    """B and W split the backward: a schedule with a split backward takes any two of --bwd-ms,
    --bwd-input-ms and --bwd-weight-ms (the third is what they leave, `split_backward`) and
    refuses three that do not add up or a half longer than the backward; one without reads B
    and W only as the backward they add up to (both given, no --bwd-ms): refuse one alone, or
    either next to --bwd-ms. A half may cost 0 (ZB-H1 with W 0 is 1F1B with a backward of B,
    the paper's formula exact), but not both: the backward they make must cost > 0, as
    --bwd-ms must."""
    b, w = args.bwd_input_ms, args.bwd_weight_ms
    if args.bwd_ms is None and b == 0 and w == 0:
        raise ValueError(
            "--bwd-input-ms 0 + --bwd-weight-ms 0 is a backward of 0 ms, and a backward must "
            "cost > 0 (as --bwd-ms must); give a positive --bwd-input-ms or --bwd-weight-ms"
        )
    if args.schedule in SPLIT_BACKWARD:
        _check_split(args)
        return
    halves = [flag_of(n) for n in ("bwd_input_ms", "bwd_weight_ms") if getattr(args, n) is not None]
    if len(halves) == 2 and args.bwd_ms is not None:  # three given: they must agree
        if not math.isclose(b + w, args.bwd_ms, rel_tol=1e-9):
            raise ValueError(
                f"--bwd-input-ms {b:g} + --bwd-weight-ms {w:g} = {b + w:g} is not --bwd-ms "
                f"{args.bwd_ms:g}: --schedule {args.schedule} runs the backward whole; give "
                f"--bwd-ms alone, or the two halves alone (their sum is the backward)"
            )
        return
    if len(halves) == 1:
        raise ValueError(
            f"{halves[0]} is not used by --schedule {args.schedule}, whose backward is not "
            f"split into B and W (only {', '.join(sorted(SPLIT_BACKWARD))} split it); give "
            f"--bwd-ms, or both --bwd-input-ms and --bwd-weight-ms (their sum is the backward)"
        )


def _check_split(args) -> None:
    b, w = args.bwd_input_ms, args.bwd_weight_ms
    if args.fwd_ms is None or (b is None and w is None):
        return  # measured (check_cost_flags refuses the halves there), or halves of the backward
    if b is not None and w is not None:
        if args.bwd_ms is not None and not math.isclose(b + w, args.bwd_ms, rel_tol=1e-9):
            raise ValueError(
                f"--bwd-input-ms {b:g} + --bwd-weight-ms {w:g} = {b + w:g} is not --bwd-ms "
                f"{args.bwd_ms:g}: B and W split the backward; give two of the three (the "
                f"third is what they leave)"
            )
        return
    name, half = ("--bwd-input-ms", b) if b is not None else ("--bwd-weight-ms", w)
    bwd = args.bwd_ms if args.bwd_ms is not None else 2 * args.fwd_ms
    if half > bwd:
        told = f"--bwd-ms {bwd:g}" if args.bwd_ms is not None else f"2 x --fwd-ms = {bwd:g}"
        raise ValueError(
            f"{name} {half:g} is longer than the backward it is part of ({told}); give the "
            f"other half too, or a --bwd-ms of at least {half:g}"
        )


def _check_step_is_finite(args, chunks: int) -> None:
    """Refuse given costs whose step overflows a float: every cost finite, but the sum of all
    of them (every stage's computes and messages, a bound on the simulated step) is not."""
    fwd = args.fwd_ms
    halves = (args.bwd_input_ms or 0.0) + (args.bwd_weight_ms or 0.0)
    bwd = args.bwd_ms if args.bwd_ms is not None else max(2 * fwd, halves)
    per_microbatch = fwd + bwd + 4 * (args.p2p_ms or 0.0)  # F, B, two messages each
    total = float(args.pp * chunks * args.microbatches) * per_microbatch
    if not math.isfinite(total):
        given = {
            n: getattr(args, n)
            for n in ("fwd_ms", "bwd_ms", "bwd_input_ms", "bwd_weight_ms", "p2p_ms")
        }
        name = max((n for n, x in given.items() if x is not None), key=lambda n: given[n])
        count = args.pp * chunks * args.microbatches
        limit = sys.float_info.max / (8 * count)  # F + 2 F backward + 4 messages, with room
        raise UsageError(
            f"{flag_of(name)} {given[name]:g}: the step's {count:,} forwards and backwards "
            f"(with their messages) add up to more than a float holds; give costs of at "
            f"most {limit:.1e} ms"
        )


def _formula_instead(args) -> str:
    """The schedule's published bubble at the sizes and costs given (F 1, backward 2 x F, B
    and W half of it, unless told): what an oversized request is told instead of a run."""
    fwd = args.fwd_ms or 1.0
    costs = Costs(
        fwd,
        args.bwd_ms or 2 * fwd,
        bwd_input_ms=args.bwd_input_ms,
        bwd_weight_ms=args.bwd_weight_ms,
    )
    b_in, b_w = costs.duration_ms("backward_input"), costs.duration_ms("backward_weight")
    value = theoretical_bubble(
        args.pp, args.microbatches, args.schedule, args.virtual_stages, fwd, b_in, b_w
    )
    if math.isnan(value):
        return f"{args.schedule}'s published formula does not apply to these costs either"
    bound = " (a lower bound)" if args.schedule in ("zb-v", "dualpipev") else ""
    shown = f"{value:.2e}" if 0 < value < 1e-4 else f"{value:.4f}"  # not 0.0000 for 3e-05
    return f"{args.schedule}'s bubble formula gives {shown}{bound}, with no run"
