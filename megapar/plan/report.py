"""Rank estimates and present them: a table, the chosen layout's megapar-train command, JSON."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence

from megapar.device import PEAK_TFLOPS, bf16_peak_of
from megapar.pipeline.partition import chunk_specs
from megapar.pipeline.placement import placement_of
from megapar.plan import experts, fp8
from megapar.plan.estimate import Estimate, layout_of, stage_memory
from megapar.plan.memory import GIB
from megapar.plan.params import model_params
from megapar.plan.problem import Problem, runs_fused_attention
from megapar.plan.state import DENSE, EXPERTS, groups_traffic, w_reported, zero_traffic
from megapar.plan.timing import chunk_times
from megapar.tensor_parallel.linear_cross_entropy import LOSS_CHUNK_TOKENS
from megapar.training.config import TrainConfig, flag_choices
from megapar.wording import counted

# Candidate option -> TrainConfig fields that would carry it, in order of preference. A flag is
# only emitted when megapar-train has the field; otherwise the command says what is missing.
_FEATURE_FIELDS = {
    "sp": ("sequence_parallel",),
    "v": ("virtual_stages", "virtual_pipeline_stages"),
    "keep_params": ("keep_params", "zero3_keep_params"),
    "offload_optimizer": ("offload_optimizer",),
    "offload_params": ("offload_params",),
}


def held(e: Estimate) -> float:
    """What the most loaded rank's device holds (`plan.process`), or its counted tensors."""
    return e.process.total if e.process is not None else e.memory.total


def rank(estimates: list[Estimate]) -> list[Estimate]:
    """Layouts that fit, fastest first (step times the table shows equal, `_seconds`, by
    memory: SP's few microseconds more do not put a layout holding more first); then the
    others, smallest first."""

    def step(e: Estimate) -> float:
        return float(_seconds(e.step_s))

    return sorted(
        estimates,
        key=lambda e: (0, step(e), held(e)) if e.fits else (1, held(e), e.step_s),
    )


def rank_word(target: str) -> str:
    """What a plan's ranks are called for `target` (`Problem.target`): "GPU" or "rank" (CPU
    ranks are processes, not devices)."""
    return "GPU" if target == "gpu" else "rank"


def ranks_phrase(n: int, target: str) -> str:
    """`n` ranks as the plan's first line names them: "16 GPUs", "1 GPU", or "4 CPU ranks"."""
    plural = "" if n == 1 else "s"
    return f"{n:,} GPU{plural}" if target == "gpu" else f"{n:,} CPU rank{plural}"


def hardware_phrase(p: Problem) -> str:
    """What the plan's first line says it assumes of each GPU (or CPU rank): its memory and
    its peak dense matmul rate in the plan's precision, and the flags that set them, e.g. "each
    80 GiB, 312 TFLOP/s peak in bf16: --gpu-memory-gb, --peak-tflops"; for CPU ranks it adds
    that the flags' defaults are a GPU's."""
    cpu = ", whose defaults are an A100's: give a CPU rank's" if p.target == "cpu" else ""
    # a known GPU's bf16 peak at fp32 (the default is an A100's) is planned as given, named so
    # here and by `peak_note`
    gpu = bf16_peak_of(p.peak_tflops, p.precision)
    rate = f"(an {gpu}'s bf16 peak) taken for fp32" if gpu else f"peak in {p.precision}"
    return (
        f"each {p.gpu_memory_gb:g} GiB, {p.peak_tflops:g} TFLOP/s {rate}: "
        f"--gpu-memory-gb, --peak-tflops{cpu}"
    )


def _size(nbytes: float) -> str:
    return f"{nbytes / GIB:>7.1f}Gi" if nbytes >= GIB else f"{nbytes / 2**20:>7.1f}Mi"


def _train_fields() -> tuple[set[str], dict]:
    return {f.name for f in dataclasses.fields(TrainConfig)}, flag_choices()


SEPARATE_MASTER_WEIGHTS = (
    "16-bit parameters with separate fp32 master weights (megapar-train "
    "keeps fp32 parameters, 16 B/param: plan with --master-weights fp32)"
)
"""What a --master-weights separate plan needs that megapar-train does not do yet."""


def runnable(e: Estimate, master_weights: str = "fp32") -> list[str]:
    """What megapar-train lacks to run this layout as planned today (empty: it runs as planned);
    `master_weights` is the plan's (--master-weights)."""
    fields, choices = _train_fields()
    c, missing = e.candidate, []
    if master_weights != "fp32":
        missing.append(SEPARATE_MASTER_WEIGHTS)
    if c.pp > 1 and c.schedule not in choices["schedule"]:
        missing.append(
            f"schedule {c.schedule} (megapar-train --schedule offers "
            f"{', '.join(choices['schedule'])})"
        )
    if c.v > 1 and not fields & set(_FEATURE_FIELDS["v"]):
        missing.append(f"{c.v} virtual stages per rank")
    if c.sp and not fields & set(_FEATURE_FIELDS["sp"]):
        missing.append("sequence parallelism")
    if c.zero not in choices["zero"]:
        missing.append(
            f"--zero {c.zero} (megapar-train --zero offers {', '.join(map(str, choices['zero']))})"
        )
    for feature, what in (
        ("offload_optimizer", "--offload-optimizer"),
        ("offload_params", "--offload-params"),
        ("keep_params", "ZeRO-3's gathered parameters kept across micro-batches"),
    ):
        if getattr(c, feature) and not fields & set(_FEATURE_FIELDS[feature]):
            missing.append(what)
    return missing


def command(e: Estimate, p: Problem, model: str) -> tuple[str, list[str]]:
    """(the megapar-train command line for the estimate's layout, notes on what it lacks)."""
    fields, _ = _train_fields()
    c = e.candidate
    flags = [
        f"--model {model}",
        f"--tp {c.tp}",
        *([f"--cp {c.cp}"] if c.cp > 1 else []),
        *([f"--cp-comm-type {c.cp_comm}"] if c.cp > 1 and c.cp_comm != "auto" else []),
        *([f"--ep {c.ep}"] if c.ep > 1 else []),
        *([f"--expert-tensor-parallel-size {c.etp}"] if c.etp > 1 else []),
        f"--pp {c.pp}",
        f"--seq-len {p.seq_len}",
        *(
            [f"--attention-mask-type {p.attention_mask_type}"]
            if p.attention_mask_type != "causal"
            else []
        ),
        f"--micro-batch-size {c.mbs}",
        f"--global-batch-size {p.global_batch}",
        *([f"--tokenizer {p.tokenizer}"] if p.tokenizer else []),
        f"--recompute {c.recompute}",
        f"--precision {p.precision}",
        # the default peak (an A100's) is left to megapar-train, which takes the GPU's own
        # datasheet figure (an A100's 312; an H100's 989, where 312 pasted logged 3.2 x its
        # MFU) and on CPU its rough 1.0 (where 312 logged 0.00 %)
        *([] if p.peak_tflops == A100_PEAK_TFLOPS else [f"--peak-tflops {p.peak_tflops:g}"]),
    ]
    missing = runnable(e, p.master_weights)
    if c.pp > 1 and not any(c.schedule in m for m in missing):
        flags.append(f"--schedule {c.schedule}")
    if c.zero:
        flags.append(f"--zero {c.zero}")
    if c.zero == 3 and c.zero3_reduce != "step":
        flags.append(f"--zero3-reduce {c.zero3_reduce}")
    if c.zero == 3 and p.zero3_persistence_threshold:
        flags.append(f"--zero3-persistence-threshold {p.zero3_persistence_threshold}")
    if p.loss_chunk_tokens != LOSS_CHUNK_TOKENS:
        flags.append(f"--loss-chunk-tokens {p.loss_chunk_tokens}")
    if p.optimizer != "adamw":
        flags.append(f"--optimizer {p.optimizer}")
    for feature, value in (
        ("sp", c.sp),
        ("v", c.v > 1),
        ("keep_params", c.keep_params),
        ("offload_optimizer", c.offload_optimizer),
        ("offload_params", c.offload_params),
    ):
        name = next((n for n in _FEATURE_FIELDS[feature] if n in fields), None)
        if value and name:
            flags.append(f"--{name.replace('_', '-')}" + (f" {c.v}" if feature == "v" else ""))
    if not p.pipeline_split.even:
        flags.append(p.pipeline_split.flags())
    if p.sp_regather and c.sp and c.tp > 1:
        flags.append("--sp-regather")
    if p.fp8 != "off":
        flags.append(f"--fp8 {p.fp8}")
        if p.fp8_layers != "auto":
            flags.append(f"--fp8-layers {p.fp8_layers}")
        if p.target == "cpu":  # no float8 matmul on a CPU: torchao's emulation
            flags.append("--fp8-emulate")
    if p.gpus <= p.gpus_per_node:
        head = f"megapar-train --dp {c.dp}"
    else:
        head = (  # every node runs it, with its own NODE_RANK (`multinode_note`)
            f"torchrun --nnodes {_nodes(p)} --nproc-per-node "
            f"{p.gpus_per_node} --node-rank $NODE_RANK --master-addr $MASTER_ADDR "
            f"--master-port 29500 -m megapar.cli.train"
        )
    return " ".join([head] + flags), missing


def _nodes(p: Problem) -> int:
    """The nodes a plan's GPUs fill."""
    return -(-p.gpus // p.gpus_per_node)


def data_note(p: Problem) -> str:
    """What `command`'s megapar-train line lacks: the data (megapar-plan reads none), without
    which the run trains on megapar's shipped sample, with gpt2's tokenizer's vocabulary in
    place of a recipe's (or --vocab-size's) where the plan was given no --tokenizer (a config
    file's vocab_size the run keeps: `Problem.vocabulary_kept`)."""
    if p.tokenizer:
        return (
            f"  note: add your corpus as --data PATH (tokenized with --tokenizer "
            f"{p.tokenizer}): without it megapar-train trains on its shipped sample"
        )
    if p.vocabulary_kept:  # a config file's vocab_size: kept whatever the data
        return (
            f"  note: add your corpus as --data PATH and its tokenizer as --tokenizer SPEC, of at "
            f"most the {p.config.vocab_size:,} ids the model config fixes: without them "
            f"megapar-train reads its shipped sample with gpt2's tokenizer"
        )
    return (
        f"  note: add your corpus as --data PATH and its tokenizer as --tokenizer SPEC (plan "
        f"with --tokenizer SPEC for the command to carry it): without them megapar-train "
        f"trains on its shipped sample with gpt2's tokenizer, whose vocabulary replaces the "
        f"model's {p.config.vocab_size:,} the plan counts"
    )


def multinode_note(p: Problem) -> str:
    """How to run `command`'s torchrun line on a job of several nodes ("" on one node)."""
    nodes = _nodes(p)
    if nodes == 1:
        return ""
    gpus = f" --gpus-per-node {p.gpus_per_node}" if p.gpus_per_node != 8 else ""
    return (
        f"  on each of the {nodes} nodes, with NODE_RANK its place (0 .. {nodes - 1}) and "
        f"MASTER_ADDR node 0's address; or launch/torchrun_multinode.sh (NNODES={nodes} "
        f"NPROC_PER_NODE={p.gpus_per_node}), or sbatch --nodes {nodes}{gpus} "
        f"launch/slurm.sbatch, with megapar-train's flags"
    )


def row(e: Estimate, master_weights: str = "fp32") -> dict:
    """One estimate as plain JSON-able values."""
    missing = runnable(e, master_weights)
    return {
        "layout": e.candidate.label(),
        "spec": e.candidate.spec(),
        "memory_gib": e.memory.as_gib(),
        "process_gib": _process_gib(e),
        "fits": e.fits,
        "bubble": e.bubble,
        "bubble_source": e.bubble_source,
        "comm_s": e.comm_s,
        "comm_share": e.comm_share,
        "compute_s": e.compute_s,
        "idle_s": e.idle_s,
        "step_s": e.step_s,
        "tokens_per_s": e.tokens_per_s,
        "mfu": e.mfu,
        "hw_tflops_per_gpu": e.hw_tflops,
        "stages": [
            {"blocks": k, "process_gib": nbytes / GIB, "busy_s": busy}
            for k, nbytes, busy in e.stages
        ],
        "runs_today": not missing,
        "missing_in_megapar_train": missing,
    }


def _process_gib(e: Estimate) -> dict | None:
    """The process figure's terms, total and bound as JSON (GiB)."""
    if e.process is None:
        return None
    pk = e.process
    return {
        "target": pk.target,
        "phase": pk.phase,
        "terms": {t.name: t.bytes / GIB for t in pk.terms},
        "tensors": pk.tensors / GIB,
        "total": pk.total / GIB,
        "baseline": pk.baseline / GIB,
        "bound": pk.bound,
    }


def table(estimates: list[Estimate], master_weights: str = "fp32", target: str = "gpu") -> str:
    """The ranked layouts, one row each, and the columns' legend, for `target`'s ranks."""
    head = (
        f"{'#':>3} {'layout':<64} {'mem/' + rank_word(target):>9} {'fits':>4} {'bubble':>10} "
        f"{'comm':>5} "
        f"{'step s':>8} {'tokens/s':>10} {'MFU':>5} {'today':>5}"
    )
    lines = [head, "-" * len(head)]
    for i, e in enumerate(estimates, 1):
        src = {"simulated": "s", "formula": "f"}.get(e.bubble_source, " ")
        lines.append(
            f"{i:>3} {e.candidate.label():<64} {_size(held(e))} "
            f"{'yes' if e.fits else 'no':>4} {100 * e.bubble:>8.1f}%{src} "
            f"{100 * e.comm_share:>4.0f}% {_seconds(e.step_s)} {e.tokens_per_s:>10.0f} "
            f"{100 * e.mfu:>4.1f}% {'yes' if not runnable(e, master_weights) else 'no':>5}"
        )
    lines.append(
        "bubble: the ranks' idle share of the step, averaged (uneven stages included); "
        "s = simulated on megapar's schedule simulator, f = published formula "
        "(schedule not in megapar, or too many actions to simulate); comm = the exposed "
        "communication's share of the step (the step = compute + it + the busiest rank's "
        "idle time, --explain's parts); mem = "
        + (
            "what the most loaded rank's device holds at its peak: its tensors, the "
            "allocator's reserve and the CUDA context"
            if target == "gpu"
            else "what the most loaded rank's process adds at its peak: its tensors, the "
            "heap's room and the runtime"
            + (
                f" (its resident set's rise over the process's baseline, "
                f"{baseline / 2**20:.0f} MiB, which --explain adds; fits compares the rise "
                f"with --gpu-memory-gb, the baseline apart)"
                if (baseline := _baseline(estimates))
                else ""
            )
        )
        + ", the terms below and in --explain; today = megapar-train can run it now"
    )
    return "\n".join(lines)


def _baseline(estimates: list[Estimate]) -> float:
    """A CPU rank's baseline resident set, as the estimates' process figures have it (0
    where they have none)."""
    first = estimates[0].process if estimates else None
    return first.baseline if first is not None else 0.0


def active_note(config) -> str:
    """For a mixture of experts, its active parameters per token (the whole model's less the
    routed experts a token is not sent to) as the plan's first line says them, e.g.
    " (12,879.9M active per token: 2 of 8 experts)"; nothing for a dense model."""
    idle = getattr(config, "idle_expert_params", 0)
    if not idle:
        return ""
    return (
        f" ({(model_params(config) - idle) / 1e6:,.1f}M active per token: "
        f"{config.num_experts_per_tok} of {config.num_local_experts} experts)"
    )


def attention_note(p) -> str:
    """The line that says how plan `p` counts attention's activations (`Problem.fused_attention`)
    on its target's ranks, and whether megapar-train runs that kernel there
    (`runs_fused_attention`)."""
    fused, target = p.fused_attention, p.target
    if fused and not runs_fused_attention(p.config, target):  # --fused-attention on a CPU
        return (
            "attention: a fused kernel's log-sum-exp counted, no a*s^2 scores, as asked "
            "(--fused-attention); megapar-train on CPU ranks runs this model's attention "
            "dropout with the unfused kernel, which keeps the scores, and megapar-train "
            "--dry-run counts those, as this plan does without --fused-attention"
        )
    if fused:
        where = "on GPUs" if target == "gpu" else "on CPU ranks without attention dropout"
        return (
            "attention: a fused kernel's log-sum-exp counted, no a*s^2 scores (what "
            f"megapar-train's scaled_dot_product_attention keeps {where}; megapar-train "
            "--dry-run counts the same); --no-fused-attention counts the scores"
        )
    return (
        "attention: the a*s^2 scores counted with their softmax and dropout mask (the "
        "unfused kernel: megapar-train on a CPU with attention dropout; on GPUs it runs a "
        "fused kernel, which keeps none), except under context parallelism"
    )


def documents_note(p) -> str | None:
    """Under --attention-mask-type block_causal, the line that says how a plan counts its
    additive mask (`Problem.attention_mask_type`); None for causal attention."""
    if p.attention_mask_type != "block_causal":
        return None
    return (
        f"block_causal: its additive mask (micro-batch x {p.seq_len} x {p.seq_len}, "
        f"{p.act_bytes} bytes an element) counted in the activations, one per micro-batch in "
        f"flight and sliding window on each model chunk (its attention keeps it for the "
        f"backward; megapar-train --dry-run counts the same); under cp by the ring or the "
        f"all-gather a block per kernel call instead, a transient"
    )


A100_PEAK_TFLOPS = 312.0
"""An A100's dense bf16 peak: `--peak-tflops`' default, and a GPU without FP8 matmuls."""


def fp8_note(p) -> str | None:
    """Under --fp8, the line that says how a plan counts float8 (`plan.fp8`), and, at an A100's
    peak, that an A100 has no FP8; None without --fp8."""
    if p.fp8 == "off":
        return None
    line = (
        f"fp8 {p.fp8}: the converted block linears' products at {p.fp8_speedup:g} x "
        f"--peak-tflops {p.peak_tflops:g} x --efficiency (--fp8-speedup), their casts' memory "
        "traffic not counted (the gain is an upper bound); MFU against the 16-bit peak"
    )
    if p.fp8 == "tensorwise":
        line += (
            "; under ZeRO-3 the float8 weights are gathered as float8 bytes, a quarter of "
            "fp32's, and their casts are those gathers (megapar-train's float8 all-gather)"
        )
    if p.peak_tflops == A100_PEAK_TFLOPS:
        line += (
            f"; --peak-tflops {A100_PEAK_TFLOPS:g} is an A100's, which has no FP8 matmuls "
            "(megapar-train refuses --fp8 there): give your FP8 GPU's 16-bit peak (H100 / "
            "H200 SXM: 989)"
        )
    return line


def peak_note(p) -> str | None:
    """At --precision fp32 and a GPU's 16-bit peak (`--peak-tflops`' default, an A100's 312, or
    an H100's 989 as the docs give it for bf16), the line that says the plan's matmul rate is
    not an fp32 job's (megapar-train runs fp32 matmuls at the GPU's fp32 rate, or its TF32 rate
    with --tf32); None otherwise."""
    name = bf16_peak_of(p.peak_tflops, p.precision)
    if name is None:
        return None
    _, tf32, fp32 = PEAK_TFLOPS[name]
    _, h100_tf32, h100_fp32 = PEAK_TFLOPS["H100"]
    others = (
        f" (H100 / H200 SXM: {h100_fp32:g}, {h100_tf32:g} with --tf32)" if name == "A100" else ""
    )
    return (
        f"--peak-tflops {p.peak_tflops:g} is an {name}'s "
        f"bf16 peak; fp32 matmuls run at its fp32 rate ({fp32:g}, {tf32:g} with megapar-train "
        f"--tf32): give your GPU's fp32 peak{others}"
    )


BUFFERS_NOTE = (
    "buffers: transient, not kept for the backward: one chunk's logits on the LM "
    "head's stage (the whole logits' fp32 gradient with --loss-chunk-tokens 0), "
    "one layer rebuilt under recomputation, context "
    "parallelism's K/V blocks in flight; megapar-train --dry-run lists them as "
    "the transients of its peak (its device bytes besides activations plus its "
    "activations are this total less the buffers)"
)
"""The line `explain` prints under the memory breakdown."""


def _seconds(s: float) -> str:
    """A step time in the table's 8 columns: 3 decimals, or 3 significant digits below 10 ms
    (a small model's step, which 3 decimals print as 0.000)."""
    return f"{s:>8.3f}" if s >= 0.01 or s == 0 else f"{s:>8.2e}"


def explain(e: Estimate, target: str = "gpu") -> str:
    """Memory and time breakdown of one estimate, on `target`'s ranks."""
    g = e.memory.as_gib()
    v = e.candidate.v
    flight = (
        f"{g['in_flight']:g} stages' worth of micro-batches in flight: "
        f"{round(g['in_flight'] * v)} counted per chunk, each chunk 1 / {v} of the stage's layers"
        if v > 1
        else f"{g['in_flight']:g} micro-batch{'' if g['in_flight'] == 1 else 'es'} in flight"
    )
    lines = [
        f"layout {e.candidate.label()}  ({e.candidate.spec()})",
        f"memory of the most loaded rank (stage {g['stage']}, {flight}): params "
        f"{g['params']:.2f} GiB, grads {g['grads']:.2f}, optimizer "
        f"{g['optimizer']:.2f}, activations {g['activations']:.2f}, buffers "
        f"{g['buffers']:.2f}"
        + (f", gathered units {g['gathered']:.2f}" if g["gathered"] else "")
        + (f", full gradient buffers {g['grad_buffers']:.2f}" if g.get("grad_buffers") else "")
        + (f", host copies {g['master']:.2f}" if g["master"] else "")
        + (f", less {g['host']:.2f} in host memory" if g["host"] else "")
        + f" = {g['total']:.2f} GiB of tensors counted; the process: "
        + (f"{e.process.total / GIB:.2f} GiB (terms below) -> " if e.process else "-> ")
        + ("fits" if e.fits else "does NOT fit"),
        BUFFERS_NOTE,
        f"time per step {e.step_s:.4f} s: compute {e.compute_s:.4f} s, exposed comm "
        + ", ".join(f"{k} {v:.4f} s" for k, v in e.comm_s.items())
        + f", idle {e.idle_s:.4f} s (the busiest rank's); bubble {100 * e.bubble:.1f} % "
        f"({e.bubble_source}, the ranks' idle share averaged)",
        f"tokens/s {e.tokens_per_s:.0f}, MFU {100 * e.mfu:.1f} %, "
        f"{e.hw_tflops:.1f} TFLOP/s per {rank_word(target)} incl. recomputation",
    ]
    if len(e.stages) > 1:
        lines.append(
            "per pipeline stage (blocks, the process's GiB, busy s a step): "
            + "; ".join(
                f"{i}: {k}, {nbytes / GIB:.2f}, {busy:.4f}"
                for i, (k, nbytes, busy) in enumerate(e.stages)
            )
        )
    return "\n".join(lines)


def expert_lines(e: Estimate, p: Problem, ranked: Sequence[Estimate] = ()) -> list[str]:
    """Why this ep, for a mixture-of-experts model (nothing for a dense one): the routed experts
    a rank holds, the weights, gradients and optimizer state that saves against ep 1 on the
    most loaded stage, the all-to-all bytes a rank sends per step and their exposed seconds,
    and the imbalance its experts' activations assume; at ep 1, the best layout of `ranked`
    with another ep and what it would take."""
    cfg, c = p.config, e.candidate
    if not experts.is_moe(cfg):
        return []
    n_exp = getattr(cfg, "num_local_experts", 0)
    by_tp = f"each split over tp {c.tp}" if c.etp > 1 else "not split by tp"
    if c.ep == 1 and c.etp > 1:
        return [
            f"experts: ep 1, etp {c.etp}: every rank holds all {n_exp} routed experts of each "
            f"MoE layer, each split over tp (1 / {c.tp} of its weights, gradients and "
            f"optimizer state); the experts' output reduced over tp per MoE layer"
        ]
    if c.ep == 1:
        other = next((x for x in ranked if x.candidate.ep > 1 and x.fits), None)
        return [
            f"experts: ep 1: every rank holds all {n_exp} routed experts of each MoE layer "
            f"(no all-to-all); the search tried every ep dividing dp and the experts"
        ] + (
            [
                f"  the fastest layout with ep > 1 that fits, {other.candidate.label()}, takes "
                f"{other.step_s:.4g} s a step against {e.step_s:.4g} s (its all-to-all "
                f"{other.comm_s.get('ep', 0.0):.4g} s exposed)"
            ]
            if other
            else []
        )
    state = e.memory.params + e.memory.grads + e.memory.optimizer
    one = stage_memory(p, dataclasses.replace(c, ep=1), simulate=False)[e.memory.stage]
    saved = one.params + one.grads + one.optimizer - state
    layers = max(
        experts.moe_layers(
            cfg,
            [
                i
                for spec in chunk_specs(
                    cfg.num_layers, c.pp, st, c.v, placement_of(c.schedule), p.pipeline_split
                )
                for i in spec.layers
            ],
        )
        for st in range(c.pp)
    )
    sent = experts.step_alltoall(p, c, layers)
    micro = p.global_batch // (c.mbs * c.dp)
    imbalance = experts.imbalance_of(cfg, p.moe_imbalance)
    edp = c.dp * c.cp // c.ep
    sharded = {
        1: f"; the experts' optimizer state sharded over their {edp} expert-data-parallel ranks",
        2: f"; the experts' gradients and optimizer state sharded over their {edp} "
        f"expert-data-parallel ranks",
    }.get(c.zero, "")
    passes = "forward and backward" + (", and recomputed" if c.recompute == "full" else "")
    return [
        f"experts: ep {c.ep}: each rank holds {n_exp // c.ep} of {n_exp} routed experts per MoE "
        f"layer ({by_tp}): its weights, gradients and optimizer state are "
        + (
            f"{_amount(state)}, {_amount(saved)} less than at ep 1{sharded}"
            if c.zero != 3
            else f"{_amount(state)}, as at ep 1{_apart(saved)} (ZeRO-3 shards each rank's E / "
            f"ep experts over cp x dp / ep ranks, ep 1's E over cp x dp)"
        ),
        *_zero3_experts(e, p, one, edp),
        f"  all-to-all per step: {_amount(sent)} put in by each rank "
        f"({counted(layers, 'MoE layer')} x {counted(micro, 'micro-batch', 'micro-batches')}: "
        f"the counts, the dispatch and the combine, {passes}), of which "
        f"{100 * experts.leaving(c.ep):.0f} % leaves the rank under uniform routing: "
        f"{e.comm_s.get('ep', 0.0):.4g} s exposed per step",
        f"  routed tokens' activations assume the busiest rank receives {imbalance:g} x the "
        f"mean rows (dropless: an assumption, megapar-train logs moe_imbalance; a capacity "
        f"factor bounds it)",
    ]


def fp8_lines(e: Estimate, p: Problem) -> list[str]:
    """Under --fp8, for the most loaded rank's stage: which block linears run in float8 there
    (training's line, `fp8.summary`), their share of the stage's matmul FLOPs and the speed-up
    it is counted at, and the amax all-reduces a step adds (nothing without --fp8)."""
    if p.fp8 == "off":
        return []
    c, stage = e.candidate, e.memory.stage
    row_ = chunk_times(p, c)[stage]
    share = sum(x.fp8_flops for x in row_) / max(sum(x.flops for x in row_), 1.0)
    m = p.global_batch // (c.mbs * c.dp)
    tp, cp = fp8.stage_reductions(p, c, stage, m)
    return [
        f"{fp8.summary(p, c, stage)} (pipeline rank {stage}, per tp rank)",
        f"  float8 products: {100 * share:.1f} % of the rank's matmul FLOPs, counted at "
        f"{p.fp8_speedup:g} x the high-precision rate (the casts' memory traffic is not "
        f"modelled: an upper bound on the gain); their weight gradients in B",
        f"  amax all-reduces a step: {tp:,} over tp, {cp:,} over cp"
        + (
            ", 1 over cp x dp (ZeRO-3's float8 all-gather's weight scales"
            + (", with 1 of those over tp" if c.tp > 1 else "")
            + ": exposed, in dp)"
            if fp8.float8_gathered(p, c)
            else ""
        )
        + f" (each its messages' latency, {p.latency_us:g} us)",
    ]


def fp8_json(p: Problem, e: Estimate | None = None) -> dict:
    """--fp8's settings (and with `e`, its stage's float8 line and amax all-reduces) for the
    JSON output; empty without --fp8, so those outputs stay as they were."""
    if p.fp8 == "off":
        return {}
    out: dict = {"fp8": p.fp8, "fp8_layers": p.fp8_layers, "fp8_speedup": p.fp8_speedup}
    if e is not None:
        c, stage = e.candidate, e.memory.stage
        tp, cp = fp8.stage_reductions(p, c, stage, p.global_batch // (c.mbs * c.dp))
        out |= {"fp8_line": fp8.summary(p, c, stage), "fp8_amax_all_reduces": [tp, cp]}
    return out


def batch_json(p: Problem, assumed: bool) -> dict:
    """The global batch for the JSON outputs: its sequences, and whether it was assumed
    (megapar-train's default, --global-batch-size not given), as the text header says."""
    return {"global_batch_size": p.global_batch, "global_batch_size_assumed": assumed}


def _zero3_experts(e: Estimate, p: Problem, one, edp: int) -> list[str]:
    """ZeRO-3 under ep: where the experts' units go (sharded over the expert-data-parallel
    group, gathered with their block), the gathered units and full gradient buffers against
    ep 1's (`one`: ep 1's memory of the stage), and the step's ZeRO traffic over each group."""
    c = e.candidate
    if c.zero != 3:
        return []
    m = p.global_batch // (c.mbs * c.dp)
    traffic = groups_traffic(
        zero_traffic(layout_of(p, c, e.memory.stage)),
        3,
        m,
        c.pp,
        keep_params=c.keep_params,
        per_micro_batch=c.zero3_reduce == "micro-batch",
        once_a_step=w_reported(c.schedule, c.pp, m, c.v),
    )
    ops = {
        group: ", ".join(f"{n} {op.replace('_', '-')}s {_amount(b)}" for op, n, b in rows)
        for group, rows in traffic.items()
    }
    where = (
        f"sharded over the {edp} expert-data-parallel ranks (cp x dp / ep)"
        if edp > 1
        else "kept whole on each rank (ep = cp x dp: the expert-data-parallel group is the "
        "rank alone): never gathered or freed, their gradients accumulated in place, with no "
        "collective, no gathered copy and no full gradient buffer"
    )
    done = ", gathered, freed and reduced with their block's unit" if edp > 1 else ""
    return [
        f"  ZeRO-3: each MoE block's experts are a unit of their own, {where}{done}: "
        f"gathered units at the peak "
        f"{_amount(e.memory.gathered)} (ep 1: {_amount(one.gathered)}), full gradient buffers "
        f"{_amount(e.memory.grad_buffers)} (ep 1: {_amount(one.grad_buffers)})",
        f"  ZeRO-3 traffic per step (an all-gather's output, a reduce-scatter's input): over "
        f"cp x dp ({c.dp * c.cp} ranks) {ops.get(DENSE, '-')}; over expert dp ({edp} "
        f"rank{'s' if edp > 1 else ''}) {ops.get(EXPERTS, '-' if edp > 1 else 'nothing')}",
    ]


def _apart(saved: float) -> str:
    """How far a ZeRO-3 rank's state at ep > 1 is from ep 1's: nothing where the two agree to
    the 0.01 MiB `_amount` shows, else ", N less" or ", N more" (never a negative "less")."""
    if abs(saved) < 0.005 * 2**20:
        return ""
    return f", {_amount(abs(saved))} {'less' if saved > 0 else 'more'}"


def _amount(nbytes: float) -> str:
    """Bytes in GiB, or MiB below one GiB."""
    return f"{nbytes / GIB:.2f} GiB" if abs(nbytes) >= GIB else f"{nbytes / 2**20:.2f} MiB"


def print_json(
    top: int,
    problem: Problem,
    estimates,
    rejected,
    cmd,
    valid: int | None = None,
    batch_assumed: bool = False,
    no_fit: str | None = None,
) -> None:
    """The ranked layouts as JSON: the global batch (`batch_json`: `batch_assumed`, it was
    megapar-train's default), the top rows, the counts (`valid`: of the valid layouts, by
    default as many as `estimates`), the rejections by reason, the chosen layout's
    megapar-train command with how to launch it on several nodes (`multinode_note`), and
    where no layout fits, the line saying what would make one (`no_fit`)."""
    reasons: dict[str, int] = {}
    for _, reason in rejected:
        key = reason.split(";")[0]
        reasons[key] = reasons.get(key, 0) + 1
    print(
        json.dumps(
            {
                "model_params": model_params(problem.config),
                "active_params": model_params(problem.config)
                - getattr(problem.config, "idle_expert_params", 0),
                **batch_json(problem, batch_assumed),
                "layouts": [row(e, problem.master_weights) for e in estimates[:top]],
                "valid": len(estimates) if valid is None else valid,
                "rejected": len(rejected),
                "rejected_reasons": reasons,
                "fused_attention": problem.fused_attention,
                "sp_regather": problem.sp_regather,
                **fp8_json(problem),
                "command": cmd[0] if cmd else None,
                "launch": (multinode_note(problem).strip() or None) if cmd else None,
                "missing_in_megapar_train": cmd[1] if cmd else None,
                "no_fit": no_fit,
            },
            indent=1,
        )
    )
