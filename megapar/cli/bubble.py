"""megapar-bubble: measure (or simulate) the pipeline bubble and show it.

    megapar-bubble --pp 2 --microbatches 8 --schedule 1f1b              # real processes
    megapar-bubble --pp 16 --microbatches 64 --simulate --fwd-ms 10 --bwd-ms 20
    megapar-bubble --pp 2 --microbatches 4 --trace trace.json --plot gantt.png
    megapar-bubble --pp 4 --microbatches 8 --show-schedule          # the schedule as data
    megapar-bubble --pp 2 --microbatches 4 --cp 2 --seq-len 256     # each stage on 2 cp ranks
    megapar-bubble --pp 4 -m 8 --schedule interleaved --virtual-stages 2 --simulate --fwd-ms 1
    megapar-bubble --pp 4 -m 8 --schedule zb-h1 --simulate --fwd-ms 1 --bwd-input-ms 1 \
                   --bwd-weight-ms 1
    megapar-bubble --certify                    # every schedule's programs, certified
    megapar-bubble --certify --pp 4 -m 8 --schedule interleaved --virtual-stages 2

Prints a table (per stage busy, idle, bubble %, theory %) and a JSON line with source
("measured" or "simulated"), measured_bubble (the simulated one under --simulate),
theoretical_bubble and step_time_s. --simulate without costs measures them
once on real processes and then simulates; the cost flags (--fwd-ms, --bwd-ms, --bwd-input-ms,
--bwd-weight-ms, --p2p-ms) are used only with --simulate and --fwd-ms. --trace and --plot are
checked (writable, not a directory) before any work. --certify prints the certificate of the
programs the executor runs (`megapar.pipeline.certify`) over a grid of schedules, pp, m and V
(narrowed by --schedule, --pp, -m, --virtual-stages when given) and exits 1 if a check fails.

--help, bad input and a simulation from given costs answer before torch is imported: what
measures, builds a model or runs real steps is imported where it is used.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from collections.abc import Callable

from megapar.cli.closed_stdout import quiet_when_stdout_closes
from megapar.disk import refused_write, write_whole
from megapar.faults.processes import exit_uncollected
from megapar.one_line_parser import OneLineParser, layout_names, shell_word
from megapar.pipeline import certify, messages, nccl_rules
from megapar.pipeline.actions import format_schedule
from megapar.pipeline.placement import chunks_per_rank
from megapar.pipeline.schedules import SCHEDULES, check_schedule, schedule_named_elsewhere
from megapar.pipeline.timeline import (
    TRACE_WRITER,
    Timeline,
    format_bubble_table,
    percent,
    plot_gantt,
    write_chrome_trace,
)
from megapar.training import bubble_run
from megapar.training.usage import UsageError, flag_of
from megapar.training.validate_bubble import MAX_SIMULATED_ACTIONS, check_bubble_args
from megapar.wording import counted

OTHER_FLAGS = {
    "--stages": "--pp",
    "--num-stages": "--pp",
    **layout_names("--tp", "--pp", "--cp"),
    "--num-microbatches": "--microbatches",
    "--dp": "megapar-bubble measures one pipeline (--pp stages of --tp x --cp ranks each): data "
    "parallelism runs copies of it side by side and adds no bubble; drop it",
    "--ep": "megapar-bubble runs a model's experts all on each stage's ranks (ep 1); drop it",
    "--virtual-pipeline-model-parallel-size": "--schedule interleaved --virtual-stages",
    "--num-virtual-stages-per-pipeline-rank": "--schedule interleaved --virtual-stages",
    "--num-layers-per-virtual-pipeline-stage": "--schedule interleaved --virtual-stages (model "
    "chunks per rank: the layers over --pp x the layers of a chunk)",
    "--num-layers": "the measured model's layers are those of --model (a recipe, or a JSON or "
    "YAML config file, e.g. a GPT-2 config with n_layer 7; they need not divide evenly over "
    "--pp); the default model has 2 per stage",
    "--json": "megapar-bubble always prints its JSON summary, as the last line of its output "
    "(| tail -n 1 > FILE keeps it); drop it",
    "--global-batch-size": "megapar-bubble takes the micro-batches per step as --microbatches "
    "(Megatron's global batch over --micro-batch-size x dp)",
}
"""Other names for megapar-bubble's flags (difflib named `--steps` for `--stages`)."""


def build_parser() -> OneLineParser:
    p = OneLineParser(
        prog="megapar-bubble",
        description=__doc__.split("\n")[0],
        known_as=OTHER_FLAGS,
        value_known_as={"--schedule": schedule_named_elsewhere},
    )
    p.add_argument("--pp", type=int, help="pipeline stages (required unless --certify)")
    p.add_argument(
        "--microbatches", "-m", type=int, help="micro-batches per step (required unless --certify)"
    )
    p.add_argument(
        "--schedule",
        choices=list(SCHEDULES),
        help="pipeline schedule (default: 1f1b; with --certify: every schedule)",
    )
    p.add_argument(
        "--virtual-stages",
        type=int,
        help="model chunks per rank (--schedule interleaved needs >= 2; zb-v and dualpipev "
        "hold 2 whatever it says, and accept 1 or 2) (default: 1)",
    )
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size per stage (default: 1)")
    p.add_argument(
        "--cp",
        type=int,
        default=1,
        help="context-parallel size per stage: each sequence split over cp ranks, "
        "whose attention exchanges keys / values inside every F and B (their "
        "time is in the measured costs; --seq-len a multiple of 2 x cp) (default: 1)",
    )
    p.add_argument(
        "--model",
        help="model recipe or JSON / YAML config file (default: a compute-bound GPT-2, "
        "2 blocks/stage)",
    )
    p.add_argument(
        "--steps",
        type=int,
        default=3,
        help="steps run after one warm-up; the last one's timeline is the measurement (the "
        "earlier ones let caches and the allocator settle) (default: 3)",
    )
    p.add_argument(
        "--micro-batch-size",
        type=int,
        default=4,
        help="sequences per micro-batch of the measured model (default: 4)",
    )
    p.add_argument(
        "--seq-len",
        type=int,
        default=64,
        help="tokens per sequence of the measured model (default: 64)",
    )
    p.add_argument(
        "--show-schedule",
        action="store_true",
        help="print each stage's program and exit: its computes (F3 = forward of "
        "micro-batch 3, B = backward, BI / BW = its input / weight halves, @1 = "
        "chunk 1) and, in brackets, the messages issued together as one "
        "batch_isend_irecv ([SA1 RG0] = send activation 1, receive gradient 0)",
    )
    p.add_argument(
        "--certify",
        action="store_true",
        help="check the programs the executor runs against NCCL's rules and the "
        "schedules' published bounds, over a grid of schedules x pp x m x V "
        "(narrowed by --schedule, --pp, -m, --virtual-stages), with real steps "
        "for pp <= 4, m <= 8; prints a table, exits 1 if a check fails "
        "(docs/guides/certificate.md)",
    )
    p.add_argument(
        "--simulate",
        action="store_true",
        help="compute the timeline from costs (--fwd-ms ...; without them, measured first in "
        "a step of the real model, after a warm-up step)",
    )
    p.add_argument(
        "--fwd-ms",
        type=float,
        help="forward cost of one micro-batch through one model chunk (a stage's "
        "whole forward, or 1/V of it with --virtual-stages V: give the chunk's)",
    )
    p.add_argument("--bwd-ms", type=float, help="backward cost (default: 2 x forward)")
    p.add_argument(
        "--bwd-input-ms",
        type=float,
        help="zero-bubble B (input-gradient) cost (default: what W leaves of the "
        "backward, or half of it)",
    )
    p.add_argument(
        "--bwd-weight-ms",
        type=float,
        help="zero-bubble W (weight-gradient) cost (default: what B leaves of the "
        "backward, or half of it)",
    )
    p.add_argument("--p2p-ms", type=float, help="point-to-point latency (default: 0)")
    p.add_argument(
        "--oversubscribe",
        action="store_true",
        help="measure with more local processes (pp x tp x cp) than 4 per CPU core "
        "(at least 8); refused otherwise",
    )
    p.add_argument("--trace", help="write a Chrome trace-event JSON (Perfetto, chrome://tracing)")
    p.add_argument(
        "--plot",
        help="write the timeline as a Gantt chart (.png added when the name has no suffix)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="let --trace / --plot replace an existing file that is not one megapar-bubble "
        "wrote (a trace or an image it wrote is replaced without it)",
    )
    return p


def _same_file(a: str, b: str) -> bool:
    """Whether paths `a` and `b` name one file: the same real path (links followed), or one
    file under two names (a hard link)."""
    a, b = os.path.expanduser(a), os.path.expanduser(b)
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # either is not there yet
        return False


def _replaces_other(path: str, flag: str) -> bool:
    """Whether --trace / --plot `path` (`flag`) is an existing file megapar-bubble did not
    write: not a trace of megapar's (its `TRACE_WRITER` mark; a profiler's trace was replaced
    without a word), or an image matplotlib did not write (its name in the file's first or
    last 4 KB: png, svg, pdf, ps, and a jpg / gif's comment, `CHART_MARK`); an empty file is
    none."""
    real = os.path.expanduser(path)
    if not os.path.isfile(real) or os.path.getsize(real) == 0:  # (an empty file holds nothing)
        return False
    try:
        if flag == "trace":
            with open(real, encoding="utf-8") as f:
                data = json.load(f)
            other = data.get("otherData") if isinstance(data, dict) else None
            return not (isinstance(other, dict) and other.get("writer") == TRACE_WRITER)
        with open(real, "rb") as f:
            head = f.read(4096)
            f.seek(max(0, os.path.getsize(real) - 4096))
            tail = f.read()
        suffix = os.path.splitext(real)[1].lower().lstrip(".")
        if suffix in ("raw", "rgba"):  # bare pixels: nothing to tell whose
            return False
        return b"matplotlib" not in (head + tail).lower()  # (a jpg / gif: its comment, CHART_MARK;
    except (OSError, ValueError):  # a tiff / webp / avif carries none: replaced with --overwrite)
        return True


COST_FLAGS = ("fwd_ms", "bwd_ms", "bwd_input_ms", "bwd_weight_ms", "p2p_ms")


def check_cost_flags(args) -> None:
    """The cost flags feed only the simulator, and only with --fwd-ms (without it, --simulate
    measures every cost): refuse them where they would be ignored."""
    given = [flag_of(n) for n in COST_FLAGS if getattr(args, n) is not None]
    if not given:
        return
    if not args.simulate:
        raise ValueError(
            f"{given[0]} is used only with --simulate; add --simulate to compute "
            f"the timeline from costs, or drop {given[0]} to measure it"
        )
    if args.fwd_ms is None:
        raise ValueError(
            f"{given[0]} needs --fwd-ms: without --fwd-ms, --simulate measures "
            f"every cost on real processes; give --fwd-ms too, or drop {given[0]}"
        )


SHAPE = ("pp", "microbatches", "schedule", "virtual_stages")
"""The pipeline every mode reads."""
MEASURE = ("tp", "cp", "model", "micro_batch_size", "seq_len", "oversubscribe")
"""What real processes are run with (a measurement, or --simulate measuring its costs)."""
OUTPUTS = ("trace", "plot")
WRITTEN = (*OUTPUTS, "overwrite")
"""The files a timeline is written to, and whether they may replace one megapar-bubble did not
write."""
MODES = {  # mode: (the options it reads, where it ignores the others, and the way out)
    "certify": (
        SHAPE,
        "with --certify (which checks the programs of every stage: the same for any --tp, "
        "--cp, model or sizes; it measures nothing)",
        "drop it",
    ),
    "show_schedule": (
        (*SHAPE, "cp"),
        "with --show-schedule (which prints the actions only)",
        "drop it",
    ),
    "simulate_costs": (
        (*SHAPE, *COST_FLAGS, *WRITTEN),
        "by --simulate with --fwd-ms (the costs are given; nothing runs)",
        "drop it, or drop the cost flags to measure them with it",
    ),
    "simulate": (  # the cost flags are check_cost_flags' (they need --fwd-ms)
        (*SHAPE, *MEASURE, *COST_FLAGS, *WRITTEN),
        "by --simulate (it measures the costs in one step)",
        "drop it, or drop --simulate to measure the bubble over real steps",
    ),
    "measure": ((*SHAPE, *MEASURE, "steps", *COST_FLAGS, *WRITTEN), "by a measurement", "drop it"),
}
"""What each of megapar-bubble's modes reads: an option given (at its default value or not)
that its mode does not read is refused, not ignored."""


def mode_of(args) -> str:
    if args.certify:
        return "certify"
    if args.show_schedule:
        return "show_schedule"
    if args.simulate:
        return "simulate_costs" if args.fwd_ms is not None else "simulate"
    return "measure"


def check_mode_flags(args, given: tuple[str, ...]) -> None:
    """ValueError naming the first option given that the chosen mode ignores (`given`: the
    options on the command line, `OneLineParser.given`)."""
    mode = mode_of(args)
    reads, where, fix = MODES[mode]
    ignored = [n for n in given if n not in reads and n != mode.removesuffix("_costs")]
    if ignored:
        raise ValueError(f"{flag_of(ignored[0])} is not used {where}; {fix}")


def plot_file(path: str, flag: str = "--plot") -> str:
    """The file matplotlib's savefig writes for `path` (it adds .png when there is no suffix);
    the suffix must be a format it can write (ValueError naming `flag` otherwise)."""
    root, ext = os.path.splitext(path)
    if os.path.exists(path) and stat.S_ISCHR(os.stat(path).st_mode):
        return path  # a device (/dev/null) is written as named: .png beside it made a file
    if not ext or ext == ".":
        return root + ".png"
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    formats = FigureCanvasAgg.get_supported_filetypes()
    if ext[1:].lower() not in formats:
        raise ValueError(
            f"{flag} {path}: matplotlib cannot write {ext} files; end the name "
            f"with .png (or one of {', '.join('.' + f for f in sorted(formats))})"
        )
    return path


def check_output_files(args) -> None:
    """--trace / --plot: files (not directories) in writable directories, not replacing a file
    megapar-bubble did not write unless --overwrite, checked before any work; args.plot becomes
    the file name matplotlib will actually write."""
    for flag in OUTPUTS:
        if getattr(args, flag) is not None and not getattr(args, flag).strip():
            raise ValueError(
                f"--{flag} is given an empty file name; give one, e.g. --{flag} "
                f"{'trace.json' if flag == 'trace' else 'gantt.png'}, or drop --{flag}"
            )
    if not (args.trace or args.plot):
        if args.overwrite:
            raise ValueError(
                "--overwrite is used only with --trace or --plot (the files it lets them "
                "replace); drop it"
            )
        return
    from megapar.training.validate import check_writable, names_directory

    if args.trace:
        if names_directory(args.trace):
            raise ValueError(
                f"--trace {args.trace} is a directory; give a file name, e.g. "
                f"--trace {shell_word(os.path.join(args.trace, 'trace.json'))}"
            )
        check_writable(args.trace, "--trace", kind="file")
    replaced = []  # files another tool wrote (or a user), said together
    if args.trace and not args.overwrite and _replaces_other(args.trace, "trace"):
        replaced.append(f"--trace {args.trace} exists and is no trace megapar-bubble wrote")
    if args.plot:
        if names_directory(args.plot):
            raise ValueError(
                f"--plot {args.plot} is a directory; give a file name, e.g. "
                f"--plot {shell_word(os.path.join(args.plot, 'gantt.png'))}"
            )
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ValueError(
                "--plot needs matplotlib (pip install matplotlib); or drop --plot "
                "and plot a --trace file later"
            ) from None
        real = plot_file(args.plot)
        if os.path.isdir(os.path.expanduser(real)):
            raise ValueError(
                f"--plot {args.plot} would write {real}, which is a directory; "
                f"give another file name"
            )
        check_writable(real, "--plot", kind="file")
        if not args.overwrite and _replaces_other(real, "plot"):
            shown = real if real == args.plot else f"{args.plot} would replace {real}, which"
            replaced.append(f"--plot {shown} exists and is no chart megapar-bubble wrote")
        if args.trace and _same_file(args.trace, real):  # (the chart replaced the trace just
            # written; through a link too, a re-test)
            named = (  # (through a link: the trace's own name was not said; a re-test)
                f"both name {real}"
                if os.path.abspath(args.trace) == os.path.abspath(real)
                else f"name one file ({args.trace} and {real})"
            )
            raise ValueError(f"--trace and --plot {named}: give each its own file name")
        args.plot = real
    if replaced:
        names = "them" if len(replaced) > 1 else "it"
        raise ValueError(
            f"{'; '.join(replaced)} (it replaces only its own outputs): give another file "
            f"name, or --overwrite to replace {names}"
        )


def check_bubble_schedule(schedule: str, pp: int, m: int, v: int, given_m: int | None) -> None:
    """`check_schedule`; where it refuses m (2 pp micro-batches pass) and -m gave it
    (`given_m`), its message names megapar-bubble's flag for m."""
    try:
        check_schedule(schedule, pp, m, v)
    except ValueError as exc:
        try:  # 2 pp micro-batches suit every schedule: if they pass, the error is about m
            check_schedule(schedule, pp, 2 * pp, v)
        except ValueError:
            raise exc from None  # about --pp or --virtual-stages: m is not the problem
        if given_m is None:
            raise
        raise ValueError(f"{exc}; m is --microbatches (-m) {given_m}") from None


def check_certify_args(args) -> list[tuple]:
    """--certify: the grid's points, narrowed by the flags given (the others are refused by
    `check_mode_flags`)."""
    for name in ("pp", "microbatches", "virtual_stages"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UsageError(f"{flag_of(name)} {value} is invalid: it must be >= 1")
    if args.pp == 1:
        raise UsageError("--pp 1 has no pipeline messages to certify; give --pp >= 2")
    pps = (args.pp,) if args.pp else certify.GRID_PP
    ms = (args.microbatches,) if args.microbatches else certify.GRID_M
    vs = (args.virtual_stages,) if args.virtual_stages else certify.GRID_V
    names = (args.schedule,) if args.schedule else None
    largest = _largest_certified(names, max(pps), max(ms), vs)
    if largest is not None and largest[2] > MAX_SIMULATED_ACTIONS:
        name, chunks, actions = largest
        per_rank = f" x {chunks} model chunks per rank" if chunks > 1 else ""
        narrow = "" if args.schedule else ", or certify one --schedule"
        raise UsageError(
            f"--certify: {name} at --pp {max(pps)} x --microbatches {max(ms)}{per_rank} is "
            f"{actions:,} actions, more than megapar-bubble certifies in seconds "
            f"({MAX_SIMULATED_ACTIONS:,}); give a smaller --microbatches or --pp{narrow}"
        )
    points = certify.grid(names, pps, ms, vs)
    if not points:  # the schedule refuses every point: say why, for the first one
        check_bubble_schedule(args.schedule or "1f1b", pps[0], ms[0], vs[0], args.microbatches)
        raise ValueError("no schedule accepts these --pp, -m and --virtual-stages")
    return points


def _largest_certified(names, pp: int, m: int, vs) -> tuple[str, int, int] | None:
    """(schedule, model chunks per rank, actions) of the largest step the grid would certify at
    `pp` and `m`: each schedule with the chunks it holds (1 for gpipe / 1f1b / zb-h1, 2 for the
    V schedules, V for interleaved), not the grid's largest V for all. None when no schedule
    takes any V of `vs` (the grid then says why)."""
    largest = None
    for name in names or SCHEDULES:
        for v in vs:
            try:
                chunks = chunks_per_rank(name, v)
            except ValueError:
                continue
            actions = 2 * pp * m * chunks
            if largest is None or actions > largest[2]:
                largest = (name, chunks, actions)
    return largest


def run_certificate(points: list[tuple], whole_grid: bool = True, schedules=None) -> int:
    """Certify `points` (training and evaluation steps; real steps where pp <= 4 and m <= 8),
    print the table; 1 if a check failed. Of the `schedules` asked for (default: every one),
    on the `whole_grid` a schedule with no point fails (nothing of it would be certified); on a
    grid narrowed by flags it is only named."""
    from megapar.pipeline import certify_real

    certs = certify.certify_grid(points)
    real = [c for c in certs if c.pp <= certify_real.REAL_MAX_PP and c.m <= certify_real.REAL_MAX_M]
    if real:
        certify_real.check_real_steps(real)
    print(certify.format_table(certs))
    missing = certify.missing_schedules(points, schedules)
    for name in missing:
        if whole_grid:
            print(
                f"FAIL {name}: no (pp, m, V) of the grid is accepted by the schedule, so "
                f"nothing of it is certified"
            )
        else:
            print(
                f"not certified: {name} (it accepts none of the --pp, -m and "
                f"--virtual-stages given)"
            )
    ok = all(c.ok for c in certs) and not (missing and whole_grid)
    print(
        f"certificate: {'every check holds' if ok else 'FAILED'} ({counted(len(certs), 'step')}, "
        f"{len(real)} of them also run as real steps; what is proven: "
        f"docs/guides/certificate.md)"
    )
    return 0 if ok else 1


def print_programs(args) -> None:
    """--show-schedule: every stage's program, checked against NCCL's rules, and its key."""
    programs = messages.programs(args.schedule, args.pp, args.microbatches, args.virtual_stages)
    for stage, program in enumerate(programs):
        print(f"stage {stage}: {format_schedule(program)}")
    nccl_rules.check_programs(programs, args.schedule)
    print(
        "key: F3 = forward of micro-batch 3, B = backward, BI / BW = its input / weight "
        "halves, @1 = model chunk 1; SA / RA = send / receive an activation, SG / RG = a "
        "gradient"
    )
    print(
        "each [...] is one batch_isend_irecv group (an NCCL group call); a compute waits "
        "only for the message it consumes; checked against NCCL's rules: no deadlock, "
        "every rank pair's messages pair in issue order"
    )
    if args.cp > 1:
        c = args.cp
        print(
            f"cp {c}: every stage runs on {c} ranks with this program; inside each F (per "
            f"layer) {c - 1} ring exchanges [send K/V to the next cp rank, receive the "
            f"previous one's], inside each B {c - 1} of K/V and {c} of dK/dV "
            f"(grouped-query Llama: an all-gather of K/V per F, an all-gather and a "
            f"reduce-scatter per B)"
        )


def simulated_run(args) -> bubble_run.BubbleRun:
    """--simulate: the schedule on the cost model, with --fwd-ms / --bwd-ms / ... (every stage
    alike) or the costs measured once on the real engine, each stage with its own (the last
    computes the head), as bubble_sweep.py does."""
    pp, m, v = args.pp, args.microbatches, args.virtual_stages
    fwd, bwd, p2p = args.fwd_ms, args.bwd_ms, args.p2p_ms or 0.0
    b_in, b_w = args.bwd_input_ms, args.bwd_weight_ms
    per_stage = None
    if fwd is None:  # measure the costs once on the real engine
        from megapar.training import bubble

        print(
            f"measuring the forward and backward costs on this machine first (one step of "
            f"the real model at pp {pp}; --fwd-ms / --bwd-ms give them and skip this)",
            flush=True,
        )
        measured = bubble.measure(
            pp,
            m,
            args.schedule,
            args.tp,
            args.model,
            1,
            args.micro_batch_size,
            args.seq_len,
            v,
            args.cp,
        )
        costs, per_stage = measured.costs, measured.stage_costs
        assert costs is not None  # a measurement records them
        fwd, bwd, p2p = costs["fwd_ms"], costs["bwd_ms"], costs["p2p_ms"]
        b_in, b_w = costs.get("bwd_input_ms"), costs.get("bwd_weight_ms")
    if bwd is None:
        bwd = b_in + b_w if b_in is not None and b_w is not None else 2 * fwd
    return bubble_run.simulate(
        pp, m, args.schedule, fwd, bwd, p2p, v, b_in, b_w, stage_costs=per_stage
    )


UNEQUAL = 1.2
"""The ratio of the busiest stage's busy time to the least busy's above which the report says
that the theory column, which assumes equal stages, does not describe the run."""


def unequal_stages_note(stats: dict, theoretical: float | None) -> str | None:
    """The line saying that the stages' busy times differ by more than `UNEQUAL` while the
    theory column assumes equal stages (a measured model's embedding and head, layers that do
    not divide evenly, another process on the cores); None where they do not."""
    busy = [r["busy_s"] for r in stats["per_rank"]]
    if theoretical is None or len(busy) < 2 or max(busy) <= UNEQUAL * min(busy):
        return None
    most, least = busy.index(max(busy)), busy.index(min(busy))
    return (
        f"theory % assumes equal stages; these differ (stage {most} busy "
        f"{1e3 * busy[most]:.1f} ms, stage {least} {1e3 * busy[least]:.1f} ms: the embedding or "
        f"the head, layers not divided evenly, or other processes on the cores): the others wait "
        f"for the busiest, so the measured bubble is not the schedule's alone"
    )


def print_report(args, run: bubble_run.BubbleRun, title: str) -> None:
    """A measured or simulated run's report: its title, bubble table, in-flight micro-batches
    and activation memory per stage, the Chrome trace and Gantt plot where asked for, and the
    JSON summary line."""
    print(title)
    print(format_bubble_table(run.stats, run.theoretical))
    if note := unequal_stages_note(run.stats, run.theoretical):
        print(note)
    if args.schedule in ("zb-v", "dualpipev") and run.costs is not None:
        own = bubble_run.equal_stage_bubble(
            args.pp, args.microbatches, args.schedule, args.virtual_stages, run.costs
        )
        bound = (  # reached where the schedule's own equals it (ZB-V from m = 3p/2 on)
            "which it reaches"
            if run.theoretical is not None and percent(own) == percent(run.theoretical)
            else "a lower bound"
        )
        print(
            f"theory % is the pipeline fill, {bound}; {args.schedule} itself at pp "
            f"{args.pp}, m {args.microbatches} on equal stages at the mean costs with free "
            f"communication: {percent(own)} %"
        )
    chunks = chunks_per_rank(args.schedule, args.virtual_stages)
    unit = (
        f", counted per chunk: a rank holds {chunks}, each with 1 / {chunks} of its layers"
        if chunks > 1
        else ""
    )
    print(f"in-flight micro-batches per stage (peak{unit}): {run.in_flight}")
    if run.activation_mb is not None:
        print(
            "activation memory per stage (peak MB held for backward): "
            + ", ".join(f"{x:.1f}" for x in run.activation_mb)
        )
    for out in filter(None, (args.trace, args.plot)):  # checked writable; created when written
        os.makedirs(os.path.dirname(os.path.abspath(os.path.expanduser(out))), exist_ok=True)
    timeline = run.timeline
    assert isinstance(timeline, Timeline)  # a measured or simulated step's
    if args.trace:
        _written("--trace", args.trace, lambda out: write_chrome_trace(timeline, out))
        print(f"wrote {args.trace}")
    if args.plot:  # a simulation's receives at --p2p-ms 0 are waits only: no comm bars
        free = args.simulate and run.costs is not None and run.costs.get("p2p_ms") == 0
        _written("--plot", args.plot, lambda out: plot_gantt(timeline, out, title, comm=not free))
        print(f"wrote {args.plot}")
    print(json.dumps(run.summary()))


def _written(flag: str, path: str, write: Callable[[str], None]) -> None:
    """`write(file)` whole or not at all onto `path` (through a link, onto the link's file;
    `disk.write_whole`, keeping the suffix that names a chart's format). Its OSError is one
    line (ValueError: a full disk was a traceback after the run, beside a file of 0 bytes; a
    re-test)."""
    real = os.path.realpath(os.path.expanduser(path))
    try:
        write_whole(real, write, os.path.splitext(real)[1])
    except OSError as exc:
        raise ValueError(refused_write(flag, path, exc)) from None


def check_measurement_memory(args) -> None:
    """ValueError (one line) when the CPU ranks a measurement forks could not hold the measured
    model's parameters and gradients (its steps run no optimizer) in the memory this machine
    has available (`megapar.plan.host`)."""
    from megapar.device import use_cuda
    from megapar.plan import Candidate, Problem
    from megapar.plan.host import check_host_memory
    from megapar.training.bubble import bench_config

    if use_cuda():
        return
    chunks = chunks_per_rank(args.schedule, args.virtual_stages)
    problem = Problem(
        bench_config(args.model, args.pp, chunks),
        args.pp * args.tp * args.cp,
        global_batch=args.microbatches * args.micro_batch_size,
        seq_len=args.seq_len,
        precision="fp32",
        target="cpu",
    )
    candidate = Candidate(
        args.tp, args.pp, 1, args.micro_batch_size, args.schedule, chunks, cp=args.cp
    )
    cp = f" x --cp {args.cp}" if args.cp > 1 else ""
    check_host_memory(
        problem,
        candidate,
        f"--model {args.model or '(the default)'} at --pp {args.pp} x --tp {args.tp}{cp}",
        "measure a smaller --model (the default one is sized for this), or simulate this one "
        "from given costs (--simulate --fwd-ms MS)",
        optimizer=False,
    )


@quiet_when_stdout_closes
def main(argv=None) -> int:
    exit_uncollected()  # torch's heap left to the OS at exit
    parser = build_parser()
    args = parser.parse_args(argv)
    given = parser.given(argv)
    if args.certify:
        try:
            check_mode_flags(args, given)
            points = check_certify_args(args)
        except (UsageError, ValueError) as exc:
            print(f"megapar-bubble: error: {exc}", file=sys.stderr)
            return 2
        narrowed = args.pp or args.microbatches or args.virtual_stages
        return run_certificate(
            points, whole_grid=not narrowed, schedules=(args.schedule,) if args.schedule else None
        )
    missing = [
        flag
        for flag, value in (("--pp", args.pp), ("--microbatches", args.microbatches))
        if value is None
    ]
    if missing:
        parser.error(
            f"the following arguments are required: {', '.join(missing)} (or use --certify)"
        )
    schedule_flag = "given" if args.schedule else "default"  # how a refusal names it
    if args.schedule is None:
        args.schedule = "1f1b"
    if args.virtual_stages is None:
        args.virtual_stages = 1
    pp, m, v = args.pp, args.microbatches, args.virtual_stages
    try:  # every argument and output: one line, exit 2, before any work or worker starts
        check_mode_flags(args, given)
        check_cost_flags(args)
        check_bubble_args(args)
        builds_no_model = args.show_schedule or (args.simulate and args.fwd_ms is not None)
        if not builds_no_model:
            from megapar.training.validate_tools import check_bubble_measurement

            check_bubble_measurement(args, schedule_flag)
            check_measurement_memory(args)
        chunks_per_rank(args.schedule, v, flags=schedule_flag)  # megapar-bubble's flags alone
        check_bubble_schedule(args.schedule, pp, m, v, m)
        check_output_files(args)  # last: it creates a missing output directory
    except (UsageError, ValueError) as exc:
        print(f"megapar-bubble: error: {exc}", file=sys.stderr)
        return 2
    if args.show_schedule:
        print_programs(args)
        return 0
    name = args.schedule + (f" V={v}" if v > 1 else "")
    if args.simulate:
        run = simulated_run(args)
        title = f"simulated {name}, pp={pp}, m={m}"
    else:
        from megapar.faults.report import log_dir_for, worker_failure
        from megapar.launcher import WorkerError
        from megapar.training import bubble

        try:
            run = bubble.measure(
                pp,
                m,
                args.schedule,
                args.tp,
                args.model,
                args.steps,
                args.micro_batch_size,
                args.seq_len,
                v,
                args.cp,
            )
        except WorkerError as exc:  # one line here, the rank's traceback in its log
            line, log = worker_failure(str(exc), log_dir_for(None, "~/.cache/megapar"))
            print(
                "megapar-bubble: error: "
                + line.replace("before training started", "in the measured run")
                + (f" (full traceback in {log})" if log else ""),
                file=sys.stderr,
            )
            return 1
        title = f"measured {name}, pp={pp}, m={m}" + (f", cp={args.cp}" if args.cp > 1 else "")
    try:
        print_report(args, run, title)
    except ValueError as exc:  # an output the disk refused (`_written`)
        print(f"megapar-bubble: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
