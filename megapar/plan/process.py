"""What one rank's process holds at its peak: the tensors' peak over a step's phases, and what
the device (a GPU's caching allocator and CUDA context) or the host (a CPU's heap) holds
beyond its tensors.

`estimate.stage_memory` counts the tensors a rank keeps (weights, gradients, optimizer state,
activations kept for backward, the loss's and recomputation's buffers). A process holds more:
transient tensors the step makes and frees, and memory its allocator keeps around them. Each
term below is named in `megapar-plan`'s output (`Term`), with the measurement it rests on in
docs/guides/planner.md ("The process at its peak").

The tensors' peak is the largest of two phases, three under ZeRO-3:

- the top of the backward (`A`): the state, every activation in flight, the buffers, autocast's
  16-bit weight copies, the head's weight gradient, (loss unchunked at tp 1) the gradient of
  the log-softmax, and one block's backward working set;
- the end of the backward on the stage with the embedding (`B`): the state, autocast's copies
  and the embedding's weight gradient (with the tied head on the same rank, two tensors of
  the embedding's size: the head's gradient autograd holds for it and the lookup's, which
  autograd adds into the held one in place);
- under ZeRO-3, a block's reduction inside the backward (`C`): the state, the buffers,
  autocast's copies, the activations not yet freed, the block and the one before it gathered,
  the gradient buffers alive then and, on a CPU, gloo's reduce-scatter pieces
  (`_inside_backward`).

On a GPU the process then holds the allocator's reserve over its tensors and the CUDA
context; on a CPU the heap's room (a share of the step's transients, under recomputation a
second place for the rebuilt layer, under sequence parallelism its holes) and the runtime's
resident memory (libraries and threads started with the job), and beside the figure, at
dp > 1 under ZeRO 0-2, what the heap may come to hold after the first steps (a second place
for the embedding's gradients: `ProcessPeak.settled`), and apart from it the process's
baseline (the interpreter and its imports), which a rise in the peak resident set, as
`tests/test_process_peak.py` measures it, does not include.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from megapar.data_parallel import shard_comm
from megapar.pipeline.placement import placement_of
from megapar.plan import fp8
from megapar.plan.context_parallel import cp_buffers
from megapar.plan.layouts import Candidate
from megapar.plan.memory import GIB, MemoryBreakdown
from megapar.plan.params import stage_expert_params, whole_casts
from megapar.plan.pipeline import loss_grads_in_forward
from megapar.plan.problem import Problem
from megapar.plan.shared import Shared
from megapar.tensor_parallel.partition import local_size

TARGETS = ("gpu", "cpu")
"""What a plan's process figure is for (`Problem.target`)."""

GPU_RESERVE = 1.09
"""The CUDA caching allocator's reserved peak over its allocated peak, by which a GPU figure
multiplies its tensors' peak; fitted on an H200 (docs/guides/planner.md, "The process at its
peak": the allocator's reserve)."""

CUDA_CONTEXT = 0.75 * GIB
"""Device memory outside the allocator (the CUDA context, cuBLAS / cuDNN workspaces) that a GPU
figure adds, as `megapar.device.cuda_context_bytes` measures it (docs/guides/planner.md, "The
process at its peak": CUDA context)."""

CPU_RUNTIME = 30 * 2**20
"""Resident memory a CPU rank adds beyond the tensors counted and the heap's room: memory
outside glibc's heap (gloo's and OpenMP's threads, libraries loaded on first use) and heap
bytes that are no counted tensors (the model's and engine's Python objects, bookkeeping,
gloo's buffers). What the heap holds beyond it is room that follows the step's transients
(`CPU_HEAP_ROOM`, `_rebuilt_layer_place`, `_sequence_parallel_holes`) and, under ZeRO-3, the
tensors of a block's reduction (`_inside_backward`); gloo's copies stay inside it and the heap's
room, as ZeRO's collectives go in pieces of `shard_comm.HOST_PIECE_BYTES` on the host. In a rank
megapar-train forks, the library pages the rank touches are `CPU_FORKED_PAGES`. Measured in
docs/guides/planner.md ("The process at its peak": runtime; "ZeRO-3 inside the backward and
the heap's room")."""

CPU_HEAP_ROOM = 0.2
"""Freed room glibc's heap holds at the peak (megapar's host policy keeps freed blocks and never
trims, `host_memory.keep_freed_host_memory`) as a share of the step's transients: the tensors
above the state at the peak and, under ZeRO 0-2, `CPU_GRADIENT_ROOM` of the parameter gradients
autograd makes and frees in the backward (`_backward_grads`). Not of ZeRO-3's gathered units,
full gradient buffers and reduce-scatter pieces, nor its backward's gradients: under ZeRO-3 a
CPU rank serves every allocation above 4 MiB with its own mapping, unmapped when freed
(`host_memory.return_freed_host_memory`), so they leave no room. Measured in
docs/guides/planner.md ("The process at its peak": heap's room)."""

CPU_GRADIENT_ROOM = 0.3
"""The heap's room over the parameter gradients the backward makes and frees under ZeRO 0-2
(`_backward_grads`), at world size > 1: each block's gradients are made at the heap's top, of
the same sizes as the last block's, whose freed places do not take them
(`_sequence_parallel_holes`). A fit of measured ranks, less certain than the tensors
(docs/guides/planner.md, "ZeRO-3 inside the backward and the heap's room")."""

CPU_HEAP_ROOM_ALONE = 0.1
"""`CPU_HEAP_ROOM` for a job of one process, where no collective's thread allocates in the heap
between the step's frees and allocations (docs/guides/planner.md, "ZeRO-3 inside the backward
and the heap's room": one process holds less room)."""

CPU_BASELINE = 329 * 2**20
"""A rank's resident set before its job when it is a process of its own (spawned, torchrun,
one process): the interpreter with torch, megapar's training modules, transformers' config and
torch._dynamo imported. torch's optimizer imports torch._dynamo when the engine builds it (its
`add_param_group` is wrapped by the lazy `torch._disable_dynamo`), so every rank holds it from
its build on; no megapar module imports it earlier (tests/test_house.py), so measurements import
it before their baseline. Reported apart: the OS's absolute peak is `ProcessPeak.total` plus
this (`cpu_baseline`). Measured in docs/guides/planner.md ("The process at its peak":
baseline)."""

CPU_FORKED_BASELINE = 236 * 2**20
"""The same for a rank megapar-train forks on a CPU (world size > 1 on one machine, no
torchrun): its resident set at its start. A forked child's resident set holds the launcher's
anonymous memory it shares copy on write (the interpreter's heap, torch's, torch._dynamo's,
imported by the launcher before it forks, and megapar's state) but, of the libraries' file
pages, only those it touches itself (`CPU_FORKED_PAGES`). Measured in docs/guides/planner.md
("The process at its peak": baseline; a forked rank's baseline is not a spawned one's)."""


CPU_FORKED_PAGES = 36 * 2**20
"""The library file pages a rank megapar-train forks touches in its first step, which a
spawned rank holds in its baseline (`CPU_BASELINE`) and a forked rank does not hold at its
start (docs/guides/planner.md, "The process at its peak": baseline)."""


def cpu_baseline(world_size: int) -> float:
    """The baseline of a CPU rank of a `world_size`-rank megapar-train job on one machine:
    where megapar-train forks its ranks (world size > 1), `CPU_FORKED_BASELINE` and the library
    pages the rank touches (`CPU_FORKED_PAGES`), else `CPU_BASELINE` (its one rank runs in the
    launcher's process, which holds every library page it touched; torchrun's ranks are
    processes of their own too)."""
    return CPU_FORKED_BASELINE + CPU_FORKED_PAGES if world_size > 1 else CPU_BASELINE


CPU_NO_WORKING_SET = True
"""On a CPU a block's backward working set, and context parallelism's attention backward
(`context_parallel.cp_buffers`, which runs inside a block's backward), are not counted above
the kept activations: autograd frees each node's saved tensors as its backward runs, so a
block's gradients take the place of its activations. The GPU figure keeps both terms. Measured
in docs/guides/planner.md ("The process at its peak": a block's backward working set; "The cp
attention on a CPU")."""

BOUNDS = {
    "gpu": (
        "GPU: within 10 % (-7.8 % to +3.8 %) of the allocator's reserved peak plus the CUDA "
        "context on an H200 measured 2026-11-26 for GPT-2 124M (4 and 16 x 1024) and Llama "
        "1.2B (4 x 2048), bf16, tp = pp = dp = 1, the whole logits (--loss-chunk-tokens 0); "
        "other layouts not measured on a GPU"
    ),
    "cpu": (
        "CPU: the OS's peak resident set: for ranks of their own (spawned, torchrun) its rise "
        "over a baseline with megapar's training modules, transformers and torch._dynamo "
        "imported, for megapar-train's forked ranks its largest process (their baseline 236 "
        "MiB). Within 10 % (benchmarks/memory/planner_layouts.py; docs/guides/planner.md, "
        "measured 2026-11-29 to 2026-12-05): one process at micro-batches under 512 tokens; "
        "recompute selective / full; tp 2 with "
        "and without SP (-8.2 % to +4.0 %); cp 1 / 2 / 4; a 25M-parameter model at dp 2 ZeRO 0-3 "
        "and offload; GPT-2 124M at dp 2 ZeRO 0-3 (-7.8 % to +5.0 %; runs whose heap grew "
        "after the first steps settled within 4.2 % of the figure after the first steps); "
        "mixtral-tiny ZeRO-3 with and without ep (+5 % / +8 %); a Llama of hidden 256 and "
        "50,261 ids at tp 2 and dp 2 ZeRO-3 (-5.3 %, -4.6 %), a Mixtral of those ids at dp 2, "
        "ep 2 ZeRO-1 (-3.4 %). Outside it, under the peak: "
        "pipeline stages, whose heap grows over the micro-batches in flight, not modelled (the "
        "wide pp 2 1F1B stage -10.4 %; that Llama at pp 2, 8 micro-batches of 256 tokens: "
        "1F1B's first stage -8 % to -14 %, GPipe's last within 1 % in the first step and "
        "-13 % to -24 % from the second); ZeRO-3 with both offloads (-17 %, not traced); "
        "micro-batches of hundreds of tokens or more (from step 2 the heap can keep a "
        "micro-batch's logits, one chunk's, once more: -31 % at gpt2-tiny 8 x 128, -11 % at "
        "llama-tiny 1 x 512; `settled` holds them: +4 % to +9 %); one process at micro-batches "
        "of 512 tokens or more, whose heap holds the embedding's gradients and a logits chunk "
        "again already in the first step (2026-12-05, fp32: gpt2-small-cpu 4 x 128 -21 %, "
        "gpt2-tiny 8 x 128 -20 %, llama-tiny 4 x 512 -18 %, bert-tiny 4 x 128 -12 %, GPT-2 "
        "124M and BERT-base 8 x 128 -11 % to -17 %; `settled`, the figure after the first "
        "steps, -9 % to +8 % there; in bf16 it can be over: +11 % at gpt2-small-cpu). The "
        "heap's room (0.2 x the "
        "transients, 0.1 in one process; 0 to 0.8 measured) is the least certain term"
    ),
}
"""The error bound `megapar-plan` prints for each target."""


class Term(NamedTuple):
    """One named amount of a process's peak (a named tuple: a search makes millions, and a
    frozen dataclass takes several times as long to make)."""

    name: str
    bytes: float
    note: str = ""
    later: bool = False
    """Held only by some runs, once past their first steps: not in `ProcessPeak.total`, in
    `ProcessPeak.settled`."""


@dataclass(frozen=True)
class ProcessPeak:
    """One rank's process at its peak, term by term."""

    target: str
    """gpu or cpu (`TARGETS`)."""
    terms: tuple[Term, ...]
    """Every term counted, in order: tensors, then the allocator's or heap's, then the
    context's or runtime's."""
    tensors: float
    """The tensors' peak: the larger phase (see the module docstring)."""
    phase: str
    """Which phase is the peak: "top of the backward", "end of the backward" or (ZeRO-3)
    "reduction of a block" (`INSIDE`)."""
    total: float
    """What the device (GPU) or the OS (CPU, its baseline apart) holds for the rank."""
    baseline: float = 0.0
    """CPU: the process's resident set before the job (`CPU_BASELINE`); 0 on a GPU."""

    @property
    def bound(self) -> str:
        return BOUNDS[self.target]

    @property
    def settled(self) -> float:
        """The figure once a run's heap has settled: `total` and the terms some runs hold only
        after their first steps (`Term.later`: the heap's second place for the embedding's
        gradients and for the logits)."""
        return self.total + sum(t.bytes for t in self.terms if t.later)


def process_peak(
    p: Problem,
    c: Candidate,
    mem: MemoryBreakdown,
    has_embedding: bool,
    has_head: bool,
    block_bytes: float,
    target: str | None = None,
    shared: Shared | None = None,
) -> ProcessPeak:
    """The process figure of the rank `mem` describes (its stage holds the embedding and / or
    the head as flagged; `block_bytes`: what one of its blocks keeps for backward without
    recomputation, `estimate.activation_sizes(...).full`), for `target` (default
    `p.target`); `shared`: the search's `Shared` work, for the terms that read no memory
    figure (`_top_terms`)."""
    target = target or p.target
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; use one of {', '.join(TARGETS)}")
    # ZeRO-3's gathered units and full gradient buffers peak at different moments: each phase
    # counts what it holds of them
    state = mem.total - mem.activations - mem.buffers - mem.gathered - mem.grad_buffers
    host = mem.host if target == "cpu" else 0.0  # offload's host memory: on a CPU, the same
    state += host
    cpu_set = target == "cpu" and CPU_NO_WORKING_SET
    # the cp attention's backward peak runs inside a block's backward: on a CPU not above the
    # kept activations, as the block's working set is not (`CPU_NO_WORKING_SET`)
    cp_peak = cp_buffers(p, c) if cpu_set else 0.0
    buffers = mem.buffers - cp_peak
    a = list(_top_terms(p, c, mem.stage, has_embedding, has_head, shared))
    a[1:1] = _zero3_terms(mem.gathered_top, mem.grad_buffers_top, "top of the backward")
    if mem.activations:
        a.append(
            Term(
                "a block's backward working set",
                0.0 if cpu_set else block_bytes,
                "not above the kept activations on a CPU (measured)"
                if cpu_set
                else "the gradients of one block's intermediates, as large as what it keeps",
            )
        )
    casts = _float8_casts(p, c, mem, target)
    if casts is not None:
        a.append(casts)
    b = _zero3_terms(mem.gathered_end, mem.grad_buffers, "end of the backward")
    b += _end_of_backward(p, c, has_embedding, has_head)
    copies = a[0]  # autocast's copies live through both phases
    kept = _float8_weight_casts(p, c, mem)  # as do the step's float8 weight casts
    if kept is not None:
        a.insert(1, kept)
    c_ = _inside_backward(p, c, mem, target, block_bytes)
    top = state + mem.activations + buffers + sum(t.bytes for t in a)
    end = state + copies.bytes + (kept.bytes if kept else 0.0) + sum(t.bytes for t in b)
    mid = state + buffers + copies.bytes + (kept.bytes if kept else 0.0)
    mid += sum(t.bytes for t in c_)
    tensors, phase = max(
        (top, "top of the backward"), (end, "end of the backward"), (mid, INSIDE), key=_first
    )
    terms = [
        Term(
            "weights, gradients, optimizer state",
            state,
            "counted (megapar-plan --explain)"
            + (f", {_size(host).strip()} of it offload's host memory" if host else ""),
        ),
        Term("activations kept for backward", mem.activations, "counted"),
        Term(
            "loss, recomputation and cp attention buffers",
            buffers,
            "counted"
            + (
                f"; the cp attention's backward peak ({_size(cp_peak).strip()}) not: it runs "
                "in a block's backward, not above the kept activations on a CPU (measured)"
                if cp_peak
                else ""
            ),
        ),
        *a,
        *b,
        *c_,
    ]
    if target == "gpu":
        reserve = (GPU_RESERVE - 1) * tensors
        terms += [Term("allocator's reserve", reserve, _RESERVE_NOTE), _CUDA_CONTEXT_TERM]
        return ProcessPeak(target, tuple(terms), tensors, phase, tensors + reserve + CUDA_CONTEXT)
    # ZeRO-3 on a CPU serves every allocation above 4 MiB with its own mapping, unmapped when
    # freed (`host_memory.return_freed_host_memory`): its units and buffers leave no room
    top_phase = phase == "top of the backward"
    if phase == INSIDE:  # the units, buffers and gloo's pieces, all mapped apart
        mapped = sum(t.bytes for t in c_ if t.name != _KEPT_INSIDE)
    elif top_phase:
        mapped = mem.gathered_top + mem.grad_buffers_top
    else:
        mapped = mem.gathered_end + mem.grad_buffers
    made = _backward_grads(p, c, mem, has_embedding, has_head)
    share = CPU_HEAP_ROOM if p.gpus > 1 else CPU_HEAP_ROOM_ALONE
    grads_share = CPU_GRADIENT_ROOM if p.gpus > 1 else CPU_HEAP_ROOM_ALONE
    room = float(round(share * (tensors - state - mapped) + grads_share * made))  # whole bytes
    holes = _sequence_parallel_holes(p, c, mem)
    terms.append(
        Term(
            "heap's freed room",
            room,
            f"{share} x the tensors above the state"
            + (" less ZeRO-3's units and buffers (mapped apart)" if mapped else "")
            + (
                f", {grads_share} x the backward's parameter gradients ({_size(made).strip()}, "
                "made and freed)"
                if made
                else ""
            ),
        )
    )
    if holes:
        terms.append(
            Term(
                "sequence parallelism's holes",
                holes,
                "SP's split activations fill holes of whole-sequence transients (the heap "
                "does not shrink), "
                + (
                    f"and its reduce-scatters' grouped copies ({_size(mem.sp_copies).strip()}) "
                    "stay as holes"
                    if mem.sp_copies
                    else "no grouped copies counted (one sequence, or full recomputation)"
                ),
            )
        )
    rebuilt = _rebuilt_layer_place(c, mem)
    if rebuilt:
        terms.append(
            Term(
                "recomputation's rebuilt layer, a second place",
                rebuilt,
                "each block's backward rebuilds a layer of the same sizes, which the last "
                "one's freed places do not take (measured)",
            )
        )
    moved = _moved_embedding_gradients(p, c, has_embedding, has_head)
    if moved:
        terms.append(
            Term(
                "embedding gradients' second place in the heap",
                moved,
                "not in the sum: after the first steps (one process: in its first) some "
                "runs' heap settles holding room for the embedding's gradients twice (measured)",
                later=True,
            )
        )
    logits = _moved_logits(p, c, has_head)
    if logits:
        terms.append(
            Term(
                "logits' second place in the heap",
                logits,
                "not in the sum: from the second step a run's heap can hold room for a "
                "micro-batch's logits (one chunk's) twice (measured)",
                later=True,
            )
        )
    terms += [
        Term(
            "runtime (threads, libraries, objects)",
            CPU_RUNTIME,
            "measured: memory outside the heap and heap bytes that are no counted tensors",
        ),
    ]
    total = tensors + room + holes + rebuilt + CPU_RUNTIME  # `moved`, `logits`: `settled`
    return ProcessPeak(target, tuple(terms), tensors, phase, total, cpu_baseline(p.gpus))


_RESERVE_NOTE = f"{GPU_RESERVE - 1:.2f} x the tensors' peak"
_CUDA_CONTEXT_TERM = Term("CUDA context", CUDA_CONTEXT, "measured on an H200")


def process_floor(mem: MemoryBreakdown) -> float:
    """A lower bound of the GPU figure `process_peak(...).total` of the rank `mem` describes:
    its state and kept activations alone, with the allocator's reserve and the CUDA context.
    The top of the backward holds them and more (every other term is >= 0), and the figure is
    the same operations, in the same order, on a peak at least as large (IEEE rounding is
    monotone), so a floor above the memory proves the rank does not fit."""
    state = mem.total - mem.activations - mem.buffers - mem.gathered - mem.grad_buffers
    tensors = state + mem.activations
    return tensors + (GPU_RESERVE - 1) * tensors + CUDA_CONTEXT


INSIDE = "reduction of a block"
"""ZeRO-3's third phase (`_inside_backward`): the tensors' peak at the reduction of a block."""

_KEPT_INSIDE = "activations still kept (at a block's reduction)"


def _first(x: tuple[float, str]) -> float:
    return x[0]


def _inside_backward(
    p: Problem, c: Candidate, mem: MemoryBreakdown, target: str, block_bytes: float
) -> list[Term]:
    """Under ZeRO-3, the third phase's terms (with the state, the buffers and the copies of
    the other phases): as a block of the stage's last chunk is reduced
    (`zero3_peaks.in_backward`), the activations not yet freed (each block's backward frees
    what it kept, `block_bytes` a block without recomputation; with recomputation none counted
    freed), the block and the one before it gathered (and the persistent unit), the gradient
    buffers alive (the roots', the block's and the one still being reduced) and, on a CPU,
    the reduce-scatter's pieces in flight: gloo copies a collective's input and holds the copy
    until it is waited for, and on the host a unit above `shard_comm.HOST_PIECE_BYTES` is
    reduced in pieces of that size, each staged contiguous, with one piece in flight while the
    next is staged (two pieces and their copies); a smaller unit is reduced whole (one copy).
    The measurements: docs/guides/planner.md, "ZeRO-3 inside the backward". None without
    ZeRO-3's units."""
    if not (mem.gathered_mid or mem.grad_buffers_mid):
        return []
    freed = block_bytes if c.recompute == "none" else 0.0
    left = max(0.0, mem.activations - mem.blocks_done_mid * freed)
    out = [
        Term(
            _KEPT_INSIDE,
            left,
            f"after {mem.blocks_done_mid:.0f} blocks' backward freed theirs",
        ),
        Term(f"ZeRO-3's gathered units ({INSIDE})", mem.gathered_mid, "the block, the one before"),
        Term(
            f"ZeRO-3's full gradient buffers ({INSIDE})",
            mem.grad_buffers_mid,
            "the roots', the block's and the one being reduced",
        ),
    ]
    if target == "cpu" and mem.reduced_mid:
        piece = shard_comm.HOST_PIECE_BYTES
        whole = mem.reduced_mid <= piece
        out.append(
            Term(
                "ZeRO-3's reduce-scatter pieces in flight",
                mem.reduced_mid if whole else 4 * piece,
                "gloo's copy of the block's gradient"
                if whole
                else "two staged pieces and gloo's copies of them",
            )
        )
    return out


def _backward_grads(
    p: Problem, c: Candidate, mem: MemoryBreakdown, has_embedding: bool, has_head: bool
) -> float:
    """On a CPU under ZeRO 0-2, the parameter gradients the step's backward makes in glibc's
    heap and frees: autograd makes each parameter's gradient before it adds it into the
    buffer's view (ZeRO 0 / 1) or ZeRO-2 stages it into a bucket and releases it, so the
    backward makes and frees one gradient of every parameter of the stage (`mem.params`, fp32
    below ZeRO-3) among its other transients; the embedding's (and the tied head's) are counted
    as tensors at the end of the backward (`_end_of_backward`), so not here. The heap's room
    follows them as it follows the other transients (`CPU_HEAP_ROOM`). Not under ZeRO-3, whose
    rank maps every allocation above 4 MiB apart and unmaps it when freed."""
    if c.zero >= 3:
        return 0.0
    vocab, h = _vocab_h(p, c)
    return max(0.0, mem.params - (vocab * h * 4 if has_embedding or has_head else 0))


def _rebuilt_layer_place(c: Candidate, mem: MemoryBreakdown) -> float:
    """On a CPU under recomputation, on a stage with activations: a second place in glibc's
    heap for the layer each block's backward rebuilds (`MemoryBreakdown.rebuilt_layer`;
    `estimate._stage_buffers` counts one).
    Every block rebuilds tensors of the same sizes at the heap's top, and a freed tensor's
    place does not take one of its own size again (glibc serves torch's 64-byte aligned
    allocations with a chunk of the size, the alignment and 32 bytes:
    `_sequence_parallel_holes`), so the heap holds the rebuilt layer again beside the one in
    use (the measurements: docs/guides/planner.md, "Recomputation's rebuilt layer"). Selective
    recomputation (the attention core rebuilt) is counted the same, not traced."""
    if c.recompute == "none" or not mem.activations:
        return 0.0
    return mem.rebuilt_layer


def _sequence_parallel_holes(p: Problem, c: Candidate, mem: MemoryBreakdown) -> float:
    """On a CPU, what sequence parallelism leaves in glibc's heap, never trimmed under megapar's
    host policy: the activation bytes it saves on `mem`'s stage (`MemoryBreakdown.sp_saved`)
    and, with more than one sequence per micro-batch, its reduce-scatters' grouped copies
    (`MemoryBreakdown.sp_copies`; 0 without SP). In each block's forward the row-parallel
    layer's whole-sequence transients (its output, with b > 1 the grouped copy, gloo's clone of
    that) are made at the heap's top and freed below the tensors kept after them; a freed
    tensor's place does not fit a tensor of its size again (glibc 2.36 serves torch's 64-byte
    aligned allocations with a chunk of size + alignment + 32 bytes), only smaller ones: SP's
    split activations, which so leave the heap as large as without SP, and the next
    all-gather's buffers. So the heap holds the split activations' saving and one more hole per
    grouped copy (docs/guides/planner.md, "Sequence parallelism's heap"). With `--sp-regather`
    `sp_saved` includes its smaller slices: the re-gathered input is one more such transient,
    so the same is expected (not measured)."""
    return mem.sp_saved + mem.sp_copies if c.sp and c.tp > 1 else 0.0


def _moved_embedding_gradients(
    p: Problem, c: Candidate, has_embedding: bool, has_head: bool
) -> float:
    """On a CPU under ZeRO 0-2, the heap room a run settles into for the embedding's weight
    gradients beyond the end of the backward's own (`_end_of_backward`): as many bytes again.
    Those gradients (the head's, made in the loss, and the lookup's) are the step's largest
    allocations, made afresh every step in glibc's heap, which megapar's host policy never trims
    (`host_memory.keep_freed_host_memory`). The heap grows by about one of them at a time, at
    steps that vary from run to run, until it holds a second place for each: then it stays. Why,
    as far as measured (not traced allocation by allocation): the next step's smaller
    allocations take part of the holes the last step's gradients left, so they no longer fit
    there; the collectives' timing, which orders the frees, would make the steps vary. One
    process grows so in its first step: BERT-base and GPT-2 124M at 8 x 128 tokens, two
    micro-batches, 148 to 295 MiB at each micro-batch's embedding backward, the heap's free room
    (about 1 GiB) then in pieces too small for a 147 MiB gradient. Not under ZeRO-3 (its rank
    maps every allocation above 4 MiB apart, `host_memory.return_freed_host_memory`). The
    measurements are in docs/guides/planner.md ("The heap after the first steps")."""
    if c.zero == 3 or not has_embedding:
        return 0.0
    return sum(t.bytes for t in _end_of_backward(p, c, has_embedding, has_head))


def _moved_logits(p: Problem, c: Candidate, has_head: bool) -> float:
    """On a CPU, on the stage with the head, the heap room a run comes to hold for its
    logits beyond the step's own: one micro-batch's fp32 logits of this rank's vocabulary (one
    chunk's with the chunked loss), the step's largest transient, which the heap comes to hold
    twice from the second step as it does the embedding's gradients
    (`_moved_embedding_gradients`). Not under ZeRO-3, whose rank maps every allocation above
    4 MiB apart. The measurements are in docs/guides/planner.md ("Outside 10 %")."""
    if not has_head or c.zero == 3:
        return 0.0
    vocab, _ = _vocab_h(p, c)
    tokens = p.seq_len // c.cp * c.mbs
    if p.loss_chunk_tokens:
        tokens = min(tokens, p.loss_chunk_tokens)
    return float(tokens * vocab * 4)


def _zero3_terms(gathered: float, grad_buffers: float, phase: str) -> list[Term]:
    """ZeRO-3's gathered units and full gradient buffers alive in `phase` (none without)."""
    if not (gathered or grad_buffers):
        return []
    return [
        Term(f"ZeRO-3's gathered units ({phase})", gathered, "counted (plan.zero3_peaks)"),
        Term(f"ZeRO-3's full gradient buffers ({phase})", grad_buffers, "counted"),
    ]


def _vocab_h(p: Problem, c: Candidate) -> tuple[int, int]:
    cfg = p.config
    return local_size(cfg.vocab_size, c.tp, cfg.make_vocab_size_divisible_by), cfg.hidden_size


def _tied(p: Problem) -> bool:
    return bool(getattr(p.config, "tie_word_embeddings", True))


def _top_terms(
    p: Problem,
    c: Candidate,
    stage: int,
    has_embedding: bool,
    has_head: bool,
    shared: Shared | None,
) -> tuple[Term, ...]:
    """`_top_of_backward` of pipeline rank `stage`, made once per search (`shared`) for the
    fields of `c` it reads: its terms read no memory figure, and a search's candidates share
    them by the thousand (those that differ in micro-batch size, recomputation, SP, dp or
    the ZeRO stage below 3 but not in what ZeRO gathers in 16 bits)."""
    if shared is None:
        return _top_of_backward(p, c, stage, has_embedding, has_head)
    head = None
    if has_head:  # the log-softmax's gradient reads the tokens at tp 1 with the whole logits
        whole = not p.loss_chunk_tokens and c.tp == 1
        head = (loss_grads_in_forward(p, c), (c.cp, c.mbs) if whole else None)
    key = (
        "process: top of the backward",
        c.tp,
        c.ep,
        c.etp,
        c.zero == 3,
        fp8.half_gathered(p, c),
        c.pp,
        c.v,
        placement_of(c.schedule),
        stage,
        has_embedding,
        head,
    )
    return shared.get(key, lambda: _top_of_backward(p, c, stage, has_embedding, has_head))


def _top_of_backward(
    p: Problem, c: Candidate, stage: int, has_embedding: bool, has_head: bool
) -> tuple[Term, ...]:
    """Phase A's transient terms on pipeline rank `stage`; the first is autocast's copies
    (also in phase B). They read no memory figure (`_top_terms`)."""
    vocab, h = _vocab_h(p, c)
    out = [_autocast_copies(p, c, stage, has_head)]
    routed = _routed_expert_casts(p, c, stage)
    if routed is not None:
        out.append(routed)
    if has_head:
        extra = p.act_bytes if p.sixteen_bit else 0
        fused = loss_grads_in_forward(p, c)  # fp32, made in the forward: an activation
        out.append(
            Term(
                "head's weight gradient",
                vocab * h * (extra if fused else 4 + extra),
                (
                    "its fp32 one made in the chunked loss's forward (counted in the "
                    "activations)" + (", a 16-bit product" if extra else "")
                    if fused
                    else "made in the head's backward before it reaches .grad"
                    + (" (16-bit, then fp32)" if extra else "")
                )
                + (", held by autograd until the embedding's arrives" if has_embedding else ""),
            )
        )
        cast = _chunked_head_cast(p, c)
        if cast is not None:
            out.append(cast)
        if not p.loss_chunk_tokens and c.tp == 1:
            s = p.seq_len // c.cp
            out.append(
                Term(
                    "log-softmax's gradient",
                    s * c.mbs * p.config.vocab_size * 4,
                    "whole logits at tp 1: torch's cross-entropy backward makes it beside "
                    "the saved log-softmax and the logits' gradient",
                )
            )
    return tuple(out)


def _autocast_copies(p: Problem, c: Candidate, stage: int, has_head: bool) -> Term:
    """Autocast's cache of 16-bit copies of the parameters the rank's ops run in 16 bits read
    whole, kept until the step's autocast region ends: of each parameter an op autocast runs
    in 16 bits reads whole (a leaf tensor). Not a norm's (run in fp32), a row-parallel
    linear's bias (added after its reduction, uncast), an embedding's or position embedding's
    (a lookup), a float8 linear's (cast from fp32 straight to float8), a weight read as a slice
    (replicated k / v heads, routed experts, the chunked loss's head: casts made per use,
    `_chunked_head_cast`) nor, under ZeRO-3, the blocks' linear weights it gathers in 16 bits
    (`fp8.half_gathered`: the linears read those instead). That leaves the column-parallel
    linears' biases, plain linears and routers (`params.whole_casts`), every parallel
    linear's weight but those ZeRO-3 gathers in 16 bits and, with the whole logits
    (--loss-chunk-tokens 0), the LM head's weight and bias (`tests/test_process_peak.py` holds
    it to the casts a step keeps, ZeRO 0-3)."""
    if not p.sixteen_bit:
        if p.precision == "fp32":
            why = "fp32 matmuls"
        else:
            why = "16-bit weights: the matmuls use them as they are, nothing to cast"
        return Term("autocast's 16-bit weight copies", 0.0, why)
    # ZeRO-1 / 2's 16-bit all-gather leaves fp32 parameters, which autocast casts as at ZeRO-0
    half = c.zero == 3 and fp8.half_gathered(p, c)
    recipe = p.fp8 if p.fp8 != "off" else "tensorwise"
    linears = fp8.block_linears(p.config_json, c.tp, recipe, p.fp8_layers)
    whole = whole_casts(p.config_json, c.tp, c.ep, c.etp)
    plain = dict(whole.blocks)
    per_kind = {
        kind: plain[kind]
        + sum(
            (x.params - x.n * x.k if x.column else 0) + (0 if half else x.n * x.k)
            for x in xs
            if p.fp8 == "off" or not x.converted
        )
        for kind, xs in linears.items()
    }
    elements = sum(per_kind[kind] for kind in fp8.stage_kinds(p, c, stage))
    head = 0
    if has_head:
        vocab, h = _vocab_h(p, c)
        head = whole.head + (0 if p.loss_chunk_tokens else vocab * h + whole.head_bias)
    float8 = fp8.converted_params(p, c, stage)
    if half:
        what = "ZeRO-3: the blocks' linears read their gathered 16-bit weights (no copy); "
    elif c.zero == 3:
        what = "ZeRO-3's units gather fp32; "
    else:
        what = ""
    return Term(
        "autocast's 16-bit weight copies",
        (elements + head) * p.act_bytes,
        f"{what}cached for the step: "
        + ("" if half else "the blocks' linear weights, ")
        + "column-parallel biases, plain linears and routers"
        + (
            ", the LM head's weight (the whole logits)"
            if has_head and not p.loss_chunk_tokens
            else ""
        )
        + "; not norms, row-parallel biases or embeddings"
        + (
            f"; nor the float8 linears' {float8:,} parameters (cast from fp32 straight to float8)"
            if float8
            else ""
        ),
    )


def _routed_expert_casts(p: Problem, c: Candidate, stage: int) -> Term | None:
    """Under ZeRO 0-2 with 16-bit autocast, on pipeline rank `stage` with routed experts: their
    weights' 16-bit casts, made per use in each MoE layer's forward (slices, not cached) and
    saved for its backward, so alive at the top of the backward: one micro-batch's, all the
    stage's MoE layers (mixtral-tiny at dp 2: 393,216 bytes at the peak,
    `tests/test_process_peak.py`). More micro-batches in flight hold more (not counted); under
    ZeRO-3 not counted either. None otherwise."""
    if not p.sixteen_bit or c.zero == 3:
        return None
    placement = placement_of(c.schedule)
    experts = stage_expert_params(
        p.config, c.tp, c.pp, c.v, placement, p.config_json, c.ep, c.etp, p.pipeline_split
    )
    if not experts[stage]:
        return None
    return Term(
        "routed experts' 16-bit casts",
        experts[stage] * p.act_bytes,
        "cast per use in each MoE layer's forward and saved for its backward (one micro-batch's)",
    )


def _chunked_head_cast(p: Problem, c: Candidate) -> Term | None:
    """With 16-bit autocast and the chunked loss, on the stage with the LM head: the loss's
    16-bit cast of this rank's real rows of the head's weight (and bias), made in its forward
    and again in its backward (`tensor_parallel.linear_cross_entropy`), alive at the top of
    the backward; no cached copy (`_autocast_copies`). None otherwise."""
    if not (p.sixteen_bit and p.loss_chunk_tokens):
        return None
    vocab, h = _vocab_h(p, c)
    rows = min(vocab, p.config.vocab_size)
    bias = whole_casts(p.config_json, c.tp, c.ep, c.etp).head_bias
    return Term(
        "the chunked loss's 16-bit cast of the head's weight",
        rows * (h + (1 if bias else 0)) * p.act_bytes,
        "its real rows, made by the loss in its forward and backward (not cached)",
    )


def _float8_weight_casts(p: Problem, c: Candidate, mem: MemoryBreakdown) -> Term | None:
    """Under --fp8 (not ZeRO-3), on a stage with float8 linears: the step's float8 casts of
    their weights, which its micro-batches share, held to the end of its backward
    (`fp8.weight_cache_bytes`). None otherwise."""
    if p.fp8 == "off":  # no float8 linear (what `weight_cache_bytes` finds, sooner)
        return None
    nbytes = fp8.weight_cache_bytes(p, c, mem.stage)
    if not nbytes:
        return None
    return Term(
        "float8 weight casts kept for the step",
        nbytes,
        "1 byte per float8 weight element"
        + (" (tensorwise: one cast)" if p.fp8 == "tensorwise" else " per axis (rowwise: two casts)")
        + ", shared by the step's micro-batches",
    )


def _float8_casts(p: Problem, c: Candidate, mem: MemoryBreakdown, target: str) -> Term | None:
    """Under --fp8, on a stage with float8 linears: what the backward of the one that
    allocates the most holds at once beyond a high-precision linear's (`fp8.largest_transient`:
    its casts' fp32 scaled copies and float8 operands; on a CPU, where the products are
    emulated, also their operands dequantised to fp32). None without --fp8."""
    if p.fp8 == "off" or not fp8.converted_params(p, c, mem.stage):
        return None
    emulate = target == "cpu"
    nbytes, linear = fp8.largest_transient(p, c, emulate)
    assert linear is not None  # the stage holds a float8 linear
    if not nbytes:
        return Term(
            "float8 casts in a linear's backward",
            0,
            f"at {c.mbs * p.seq_len // c.cp} tokens no float8 linear's backward allocates "
            "more than its high-precision backward",
        )
    return Term(
        "float8 casts in a linear's backward",
        nbytes,
        f"{linear.name} {linear.n}x{linear.k} at {c.mbs * p.seq_len // c.cp} tokens: the "
        "casts' fp32 copies and float8 operands"
        + (" and the emulated products' fp32 operands" if emulate else "")
        + ", beyond a high-precision linear's backward",
    )


def _end_of_backward(p: Problem, c: Candidate, has_embedding: bool, has_head: bool) -> list[Term]:
    """Phase B's terms: the embedding's weight gradient at the end of the backward."""
    if not has_embedding:
        return []
    vocab, h = _vocab_h(p, c)
    both = _tied(p) and has_head
    # autograd sums the two in place into the held one (it holds its only reference); under
    # ZeRO-3 the sum becomes the root unit's full gradient buffer, which
    # `MemoryBreakdown.grad_buffers` counts
    copies = (2 if both else 1) - (1 if c.zero == 3 else 0)
    return [
        Term(
            "embedding's weight gradient (end of the backward)",
            vocab * h * 4 * copies,
            "the lookup's dense gradient"
            + (" and the head's held one, summed in place" if both else "")
            + (" (ZeRO-3: the sum is the root unit's gradient buffer)" if c.zero == 3 else "")
            + "; in the phase at the end of the backward, instead of the activations",
        )
    ]


def describe(peak: ProcessPeak) -> str:
    """The terms as a table (MiB / GiB), the total and the error bound."""
    width = max(len(t.name) for t in peak.terms)
    where = "the device holds" if peak.target == "gpu" else "the process adds (OS peak rise)"
    lines = [f"memory terms counted ({peak.target}; the tensors' peak is at the {peak.phase}):"]
    for t in peak.terms:
        lines.append(f"  {t.name:<{width}} {_size(t.bytes):>10}  {t.note}")
    lines.append(f"  {'= ' + where:<{width}} {_size(peak.total):>10}")
    if peak.settled != peak.total:
        settled = "  after the first steps, up to"
        lines.append(
            f"  {settled:<{width}} {_size(peak.settled):>10}  with the terms marked later (some "
            f"runs' heap grows to them)"
        )
    if peak.baseline:
        lines.append(
            f"  {'+ baseline (interpreter, imports)':<{width}} {_size(peak.baseline):>10}  "
            f"= {_size(peak.total + peak.baseline).strip()} at the OS's peak resident set"
            + (
                f" ({_size(peak.settled + peak.baseline).strip()} after the first steps)"
                if peak.settled != peak.total
                else ""
            )
        )
    lines.append(f"error bound: {peak.bound}")
    return "\n".join(lines)


def _size(nbytes: float) -> str:
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB else f"{nbytes / 2**20:.1f} MiB"
