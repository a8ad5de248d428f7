"""ZeRO's data-parallel traffic per step, and the part of it (and of offload's host copies) a
step waits for.

Per optimizer step of m micro-batches, over the r = dp x cp ranks that hold the same parameters
(bytes are whole tensors: an all-gather's output, a reduce-scatter's input, as the dry run
counts them; a ring moves (r - 1) / r of them per rank, an all-reduce twice that):

    zero 0   one all-reduce of the gradients (last backward)
    zero 1   one reduce-scatter of the gradients + one all-gather of the parameters (after
             the step): the bytes of one all-reduce
    zero 2   a reduce-scatter per micro-batch (m x, as DeepSpeed: the gradient is kept only as
             this rank's shard between micro-batches; at pp > 1 the buckets holding the tied
             embedding once, after its sum over the stages) + one all-gather of the parameters
    zero 3   an all-gather of each unit before its forward and again before its backward, per
             micro-batch (2 m x; a chunk's root unit, kept from its forward to its backward,
             m x; with --zero3-keep-params, and for the persistent unit, once per step), and
             one reduce-scatter of each unit per step (its full gradient
             accumulates the micro-batches, as `ShardedParams` does): at m = 1, 1.5 x an
             all-reduce, less the root's second gather

Time exposed: a reduce-scatter hides behind its micro-batch's backward, an all-gather of the
next unit behind the current unit's forward (or backward), except what is longer, and the first
unit's gather of each pass is waited for; zero 1 / 2's parameter all-gather after the step is
exposed. Offload adds host copies over PCIe: --offload-optimizer the stepped gradients down and
the parameters back each step (exposed), --offload-params this rank's shard brought up before
each gather. The optimizer step itself (on the device or the host) is not modelled.
"""

from __future__ import annotations

from megapar.optim.precision import comm_dtypes


def reduce_scale(zero: int, precision: str, grad_reduce_dtype: str = "auto") -> float:
    """The reduced gradients' bytes per fp32 byte: ZeRO-3 reduce-scatters in fp32
    (`ShardedParams` takes no reduce dtype), the others in the job's reduce dtype
    (`comm_dtypes`: fp16 under fp16, else fp32, unless --grad-reduce-dtype says)."""
    if zero >= 3:
        return 1.0
    return comm_dtypes(precision, "auto", grad_reduce_dtype)[1].itemsize / 4


def dp_traffic(
    zero: int,
    m: int,
    pp: int,
    keep_params: bool,
    grad_bytes: float,
    param_bytes: float,
    pieces: int = 1,
    persistent: float = 0.0,
    per_micro_batch: bool = False,
    deferred: tuple[int, float] = (0, 0.0),
    once_a_step: bool = False,
    tail: tuple[int, float] = (0, 0.0),
) -> list[tuple[str, int, float]]:
    """[(operation, calls, bytes in all)] one rank issues over dp x cp in a step: `grad_bytes`
    / `param_bytes` are the stage's (padded) gradient and parameter buffers as reduced and
    gathered, `pieces` its buckets (zero 0-2) or units (zero 3), each one call; `persistent`
    the bytes of ZeRO-3's persistent unit among them (one of the `pieces`). ZeRO-2, and ZeRO-3
    `per_micro_batch` (--zero3-reduce micro-batch): every bucket or unit reduce-scattered m
    times but the `deferred` (buckets or units, bytes) holding the tied embedding over stages,
    once.
    `once_a_step`: the schedule reports weight gradients once a step (`state.w_reported`), so
    ZeRO-2's and ZeRO-3's per-micro-batch reductions run once. `tail`: ZeRO-3's (units, bytes)
    of root units among the `pieces` (`state.zero_traffic`'s `Traffic.tail`), gathered once a
    micro-batch."""
    if zero == 0:
        return [("all_reduce", pieces, grad_bytes)]
    if zero in (1, 2):
        times = m if zero == 2 and not once_a_step else 1
        return [
            (
                "reduce_scatter",
                times * (pieces - deferred[0]) + deferred[0],
                times * (grad_bytes - deferred[1]) + deferred[1],
            ),
            ("all_gather", pieces, param_bytes),
        ]
    gathers, once = (1 if keep_params else 2 * m), (1 if persistent else 0)
    tails = 1 if keep_params else m
    times = m if per_micro_batch and not once_a_step else 1
    return [
        (
            "all_gather",
            gathers * (pieces - once - tail[0]) + tails * tail[0] + once,
            gathers * (param_bytes - persistent - tail[1]) + tails * tail[1] + persistent,
        ),
        (
            "reduce_scatter",
            times * (pieces - deferred[0]) + deferred[0],
            times * (grad_bytes - deferred[1]) + deferred[1],
        ),
    ]


def ring_seconds(op: str, n: int, nbytes: float, gbps: float, latency_us: float) -> float:
    """A ring collective over n ranks of a tensor of `nbytes`: an all-reduce 2 (n - 1) steps
    of nbytes / n, a reduce-scatter or all-gather half of that."""
    if n == 1:
        return 0.0
    steps = 2 * (n - 1) if op == "all_reduce" else n - 1
    return steps * (nbytes / n * 8 / (gbps * 1e9) + latency_us * 1e-6)


def dp_seconds(
    zero: int,
    m: int,
    pp: int,
    keep_params: bool,
    n: int,
    grad_bytes: float,
    param_bytes: float,
    units: int,
    gbps: float,
    latency_us: float,
    t_f: float,
    t_b: float,
    upload_s: float = 0.0,
    per_micro_batch: bool = False,
    once_a_step: bool = False,
    experts: tuple[int, float, float] = (1, 0.0, 0.0),
) -> float:
    """Seconds of a step's dp traffic that are not hidden (see the module docstring): `t_f` /
    `t_b` one micro-batch's forward / backward, `units` ZeRO-3's units of the stage, and
    `upload_s` the host-to-device copy of this rank's parameter shard before each ZeRO-3
    gather (--offload-params); `per_micro_batch`: ZeRO-3's reduce-scatter in every
    micro-batch's backward, each behind its own; `once_a_step`: as in `dp_traffic`.
    `experts`: (ranks, gradient bytes, parameter bytes) of the routed experts under expert
    parallelism, reduced and gathered over their expert-data-parallel group (cp x dp / ep
    ranks) besides `grad_bytes` / `param_bytes` over `n`; their rings run one after the
    other, hidden behind the same compute."""
    per_micro_batch = per_micro_batch and not once_a_step
    ranks, expert_grads, expert_params = experts
    rs = ring_seconds("reduce_scatter", n, grad_bytes, gbps, latency_us)
    ag = ring_seconds("all_gather", n, param_bytes, gbps, latency_us)
    if expert_grads or expert_params:
        rs += ring_seconds("reduce_scatter", ranks, expert_grads, gbps, latency_us)
        ag += ring_seconds("all_gather", ranks, expert_params, gbps, latency_us)
    if zero == 0:
        ar = ring_seconds("all_reduce", n, grad_bytes, gbps, latency_us)
        ar += ring_seconds("all_reduce", ranks, expert_grads, gbps, latency_us)
        return max(0.0, ar - t_b)
    if zero in (1, 2):
        return (m if zero == 2 and not once_a_step else 1) * max(0.0, rs - t_b) + ag
    ag += upload_s
    first = ag / max(units, 1)  # the first unit of a pass has nothing to hide behind
    if keep_params:
        return first + max(0.0, ag - first - t_f) + m_rs(rs, t_b, m, per_micro_batch)
    if per_micro_batch:
        return m * (2 * first + max(0.0, ag - first - t_f) + max(0.0, ag - first + rs - t_b))
    # the gradients reduce once, after the last micro-batch's backward
    return (
        m * (2 * first + max(0.0, ag - first - t_f))
        + (m - 1) * max(0.0, ag - first - t_b)
        + max(0.0, ag - first + rs - t_b)
    )


def m_rs(rs: float, t_b: float, m: int, per_micro_batch: bool) -> float:
    """ZeRO-3's exposed reduce-scatter time with kept parameters: once after the last
    backward, or per micro-batch behind each backward."""
    return (m if per_micro_batch else 1) * max(0.0, rs - t_b)


def pcie_seconds(nbytes: float, gbps: float) -> float:
    """Copying `nbytes` between host and device at `gbps` Gbit/s."""
    return nbytes * 8 / (gbps * 1e9)
