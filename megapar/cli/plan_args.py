"""megapar-plan's checks of its arguments: sizes, hardware figures and modes that no layout can
have or that cannot run together, each refused in one line (a ValueError naming the flag and
the fix) before the search starts."""

from __future__ import annotations

import math
import os

from megapar.checkpoint.hf import model_rows
from megapar.data.tokenizers import load_tokenizer
from megapar.device import too_fast
from megapar.dryrun.sample import MAX_DRY_RUN_WORLD
from megapar.mesh import LayoutError, tp_spans_nodes
from megapar.models.config import load_config_file, no_experts
from megapar.optim.optimizer import NOT_OFFLOADED
from megapar.pipeline.partition import PipelineSplit, split_layers
from megapar.pipeline.schedules import placement_of
from megapar.plan.layouts import chunk_counts, default_cp_sizes, divisors
from megapar.wording import or_list

MAX_VERIFY = 32
"""Most layouts --verify dry-runs in one run (each takes seconds: docs/guides/planner.md)."""


def check_layout_arguments(args) -> None:
    """ValueError if the sizes the layouts are made of (GPUs, nodes, batch, cp sizes, micro-batch
    sizes, virtual stages) are invalid."""
    for name in ("gpus", "gpus_per_node", "global_batch_size", "seq_len", "top"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.cp_sizes and min(args.cp_sizes) < 1:
        raise ValueError(f"--cp-sizes {min(args.cp_sizes)} is invalid: sizes are >= 1")
    for cp in args.cp_sizes or ():
        if args.gpus % cp:
            raise ValueError(
                f"--cp-sizes {cp} does not divide --gpus {args.gpus}: every layout "
                f"is tp x cp x pp x dp = --gpus; give divisors of {args.gpus}"
            )
        if cp > 1 and args.seq_len % (2 * cp):
            raise ValueError(
                f"--cp-sizes {cp} cannot split --seq-len {args.seq_len}: cp cuts "
                f"each sequence into 2 x cp = {2 * cp} chunks; give sizes whose "
                f"2 x cp divides {args.seq_len}, or another --seq-len"
            )
    if min(args.micro_batch_sizes) < 1:
        raise ValueError(
            f"--micro-batch-sizes {min(args.micro_batch_sizes)} is invalid: sizes "
            f"are sequences per micro-batch, >= 1"
        )
    if min(args.virtual_stages) < 2:
        raise ValueError(
            f"--virtual-stages {min(args.virtual_stages)} is invalid: they are the "
            f"model chunks per rank tried for the interleaved schedule, >= 2 (one "
            f"chunk per rank is the 1f1b schedule)"
        )
    if args.gpus > args.gpus_per_node and args.gpus % args.gpus_per_node:
        raise ValueError(
            f"--gpus {args.gpus} spans several nodes of --gpus-per-node "
            f"{args.gpus_per_node} but is not a multiple of it (torchrun starts "
            f"the same number of processes on every node); use a multiple of "
            f"{args.gpus_per_node}, or the --gpus-per-node each node really uses"
        )


def check_number_arguments(args) -> None:
    """ValueError if a hardware figure (memory, speed, bandwidth, latency, efficiency) or the
    ZeRO-3 persistence threshold is invalid."""
    for name in ("gpu_memory_gb", "peak_tflops", "intra_node_gbps", "inter_node_gbps", "pcie_gbps"):
        value = getattr(args, name)
        if not (math.isfinite(value) and value > 0):
            raise ValueError(
                f"--{name.replace('_', '-')} {value:g} is invalid: it must be a finite number > 0"
            )
    if args.loss_chunk_tokens < 0:
        raise ValueError(
            f"--loss-chunk-tokens {args.loss_chunk_tokens} is invalid: give tokens per "
            f"chunk >= 1, or 0 for the whole logits"
        )
    if args.zero3_persistence_threshold < 0:
        raise ValueError(
            f"--zero3-persistence-threshold {args.zero3_persistence_threshold} is "
            f"invalid: give a number of elements >= 0 (0: none persist)"
        )
    if args.moe_imbalance is not None and not 1 <= args.moe_imbalance < math.inf:
        raise ValueError(
            f"--moe-imbalance {args.moe_imbalance:g} is invalid: give a finite number >= 1"
        )
    if not (math.isfinite(args.latency_us) and args.latency_us >= 0):
        raise ValueError(f"--latency-us {args.latency_us:g} is invalid: it must be >= 0")
    if not (math.isfinite(args.fp8_speedup) and args.fp8_speedup > 0):
        raise ValueError(
            f"--fp8-speedup {args.fp8_speedup:g} is invalid: it must be a finite number > 0"
        )
    if refusal := too_fast(args.peak_tflops):  # GFLOP/s meant (989e3)
        raise ValueError(refusal)
    if not 0 < args.efficiency <= 1:
        percent = (
            f" ({args.efficiency:g} % is {args.efficiency / 100:g})"
            if 5 <= args.efficiency <= 100  # a percentage (1.5 is no share at all)
            else ""
        )
        raise ValueError(
            f"--efficiency {args.efficiency:g} is invalid: give the share of the peak matmuls "
            f"reach, in (0, 1]{percent}"
        )


def offload_refused(given: str, optimizer: str) -> str:
    """The line for an offload (`given`: the flag or --explain's key as given) planned with an
    --optimizer that megapar-train's --offload-optimizer refuses (`NOT_OFFLOADED`)."""
    drop = "offload= from --explain" if given.startswith("--explain") else "--offload"
    return (
        f"{given} plans megapar-train's --offload-optimizer, which steps AdamW or SGD on the "
        f"host, not --optimizer {optimizer}: drop {drop}, or plan --optimizer adamw"
    )


def check_mode_arguments(args) -> None:
    """ValueError if --verify or --today cannot run with the other flags, or --optimizer with
    --master-weights separate or an --offload megapar-train refuses with it."""
    if args.verify < 0:
        raise ValueError(
            f"--verify {args.verify} is invalid: it is how many of the best "
            f"layouts to dry-run (0: none)"
        )
    if args.verify and args.gpus > MAX_DRY_RUN_WORLD:
        raise ValueError(
            f"--verify: jobs of {args.gpus:,} ranks are more than a dry run "
            f"rehearses ({MAX_DRY_RUN_WORLD:,} ranks); rehearse a layout's "
            f"megapar-train command with --dry-run at a smaller dp (keep "
            f"--global-batch-size / dp)"
        )
    if args.verify > MAX_VERIFY:
        raise ValueError(
            f"--verify {args.verify} is more layouts than one run dry-runs (at "
            f"most {MAX_VERIFY}: each takes seconds to minutes here, GPT-3 175B's "
            f"on 1024 GPUs 5-10 s); verify the best few, and another layout with "
            f"--explain LAYOUT and its megapar-train command with --dry-run"
        )
    if args.verify and (args.explain is not None or args.json):
        mode = "--explain" if args.explain is not None else "--json"
        raise ValueError(
            f"--verify is not run with {mode} (it dry-runs a search's best layouts and "
            f"prints the comparison as text); drop {mode}, or drop --verify (for one layout: "
            f"its megapar-train command with --dry-run)"
        )
    if args.verify and args.master_weights != "fp32":
        raise ValueError(
            "--verify compares the plan with what megapar-train holds, fp32 "
            "parameters: drop --master-weights separate"
        )
    if args.optimizer != "adamw" and args.master_weights != "fp32":
        raise ValueError(
            f"--optimizer {args.optimizer} is counted as megapar-train holds it, with fp32 "
            f"parameters: drop --master-weights separate (or --optimizer {args.optimizer})"
        )
    if args.optimizer in NOT_OFFLOADED and set(args.offload) != {"none"}:
        raise ValueError(offload_refused(f"--offload {' '.join(args.offload)}", args.optimizer))
    if args.today and args.master_weights != "fp32":
        raise ValueError(
            "--today plans what megapar-train runs now, and it keeps fp32 "
            "parameters: drop --master-weights separate (or drop --today)"
        )


def check_search_arguments(args, config, given: tuple[str, ...] = ()) -> None:
    """ValueError if an option names a setting no layout reads (`--moe-imbalance` for a model
    without experts; `given`, `OneLineParser.given`: an option of the search's layouts that
    none of them has, see `check_unread_options`), or if the search's ZeRO stages and offloads
    leave no layout to try (ZeRO at one GPU, `--offload both` without ZeRO-3): the search would
    reject nothing for it and name another reason, or none."""
    if args.moe_imbalance is not None and not getattr(config, "num_moe_layers", 0):
        raise ValueError(
            f"--moe-imbalance applies to a mixture-of-experts model {no_experts(config)}: "
            f"remove the flag"
        )
    etp = args.expert_tensor_parallel_size
    if etp is not None and etp < 1:
        raise ValueError(
            f"--expert-tensor-parallel-size {etp} is invalid: give 1 (experts whole) or the tp "
            f"size to split them over"
        )
    if etp is not None and etp > 1 and not getattr(config, "num_moe_layers", 0):
        raise ValueError(
            f"--expert-tensor-parallel-size {etp} splits a mixture of experts' routed experts "
            f"over tp, and this {config.model_type} model has none: remove the flag"
        )
    comm = args.cp_comm_type
    if comm not in (None, "auto") and max(args.cp_sizes or default_cp_sizes(args.seq_len)) == 1:
        raise ValueError(
            f"--cp-comm-type {comm} chooses how context-parallel attention communicates, and "
            f"the search tries cp 1 only: add --cp-sizes (e.g. 1 2 4), or drop the flag"
        )
    if args.explain is not None:  # one layout: its own zero= and offload= are checked with it
        return
    tps = [t for t in divisors(args.gpus) if not tp_spans_nodes(t, args.gpus, args.gpus_per_node)]
    if etp is not None and etp not in tps:
        raise ValueError(
            f"--expert-tensor-parallel-size {etp} splits each routed expert over a layout's tp "
            f"ranks (it is 1 or the tp), and the tp sizes of --gpus {args.gpus} within a node "
            f"of --gpus-per-node {args.gpus_per_node} are {or_list(list(map(str, tps)))}: give "
            f"one of them, or drop it"
        )
    listed = " ".join(map(str, args.zero_stages))
    stages = [z for z in args.zero_stages if z == 0 or args.gpus > 1]
    if not stages:
        raise ValueError(
            f"--zero-stages {listed}: ZeRO shards over the data-parallel ranks, and --gpus 1 "
            f"has one: add 0 to --zero-stages, or raise --gpus"
        )
    if set(args.offload) == {"both"} and 3 not in stages:
        why, fix = _no_zero3(args)
        raise ValueError(
            f"--offload both moves ZeRO-3's parameter shards to the host, and {why}: {fix}, "
            f"or try the other offloads too (--offload none optimizer both)"
        )
    check_unread_options(args, stages, given)


def check_split_arguments(args, config, split: PipelineSplit) -> None:
    """ValueError if the uneven pipeline split (`split`: --decoder-first / last-pipeline-num-
    layers, the embedding or loss counted as a layer) fits no pp the search tries (a divisor of
    --gpus) with any of its schedules' chunks per rank (--schedules; --virtual-stages for the
    interleaved one): every layout would be rejected for it. The refusal is the fewest
    stages' (pp 2, its first schedule), in the planner's words (pp, not megapar-train's --pp)."""
    if split.even:
        return
    pps = [pp for pp in divisors(args.gpus) if pp > 1]
    if not pps:
        raise ValueError(
            f"{split.flags()} cuts the layers over pipeline stages, and --gpus {args.gpus} has "
            f"no pp > 1: drop it, or raise --gpus"
        )
    chunkings = [
        (v, placement_of(name))
        for name in args.schedules
        for v in chunk_counts(name, args.virtual_stages)
    ]
    refusals = []
    for pp in pps:
        for v, placement in chunkings:
            what = f"--pp {pp} stages" if v == 1 else f"--pp {pp} x {v} = {pp * v} model chunks"
            try:
                split_layers(config.num_layers, pp * v, split, what, v, placement)
                return
            except LayoutError as exc:
                refusals.append(str(exc).replace("--pp ", "pp "))
    tried = ", ".join(map(str, pps))
    raise ValueError(
        refusals[0] + ("" if len(pps) == 1 else f" (no pp the search tries fits: {tried})")
    )


def check_unread_options(args, stages: list[int], given: tuple[str, ...]) -> None:
    """ValueError naming an option given (`given`) that no layout of the search reads, as it
    would be ignored without a word: --zero3-persistence-threshold without ZeRO-3 among the
    stages tried (`stages`: --zero-stages where there are dp ranks), --pcie-gbps without an
    offload, --virtual-stages without the interleaved schedule, --sp-regather where no layout
    has sequence parallelism at tp > 1 (no tp > 1 fits a node, or --recompute full only, under
    which the layers keep the gathered input)."""
    if "zero3_persistence_threshold" in given and 3 not in stages:
        why, fix = _no_zero3(args)
        raise ValueError(
            f"--zero3-persistence-threshold applies to ZeRO-3 layouts, and {why}: drop it, or {fix}"
        )
    if "pcie_gbps" in given and set(args.offload) == {"none"}:
        raise ValueError(
            "--pcie-gbps is the host-device bandwidth of offload's copies, and --offload "
            "none tries no offload: drop it, or add optimizer (or both) to --offload"
        )
    if "virtual_stages" in given and "interleaved" not in args.schedules:
        listed = " ".join(args.schedules)
        raise ValueError(
            f"--virtual-stages is the chunks per rank of the interleaved schedule, and "
            f"--schedules {listed} has no interleaved (zb-v and dualpipev have 2 chunks per "
            f"rank each): drop it, or add interleaved to --schedules"
        )
    if not args.sp_regather:
        return
    if not any(args.gpus % tp == 0 for tp in range(2, min(args.gpus, args.gpus_per_node) + 1)):
        raise ValueError(
            f"--sp-regather applies to layouts with sequence parallelism at tp > 1, and no "
            f"tp > 1 divides --gpus {args.gpus} within a node of --gpus-per-node "
            f"{args.gpus_per_node}: drop it, or raise "
            + ("--gpus-per-node" if args.gpus > 1 else "--gpus")
            + (" and --gpus-per-node" if args.gpus == 1 and args.gpus_per_node == 1 else "")
        )
    if set(args.recompute) == {"full"}:
        raise ValueError(
            "--sp-regather applies to layouts with sequence parallelism, and not under "
            "--recompute full, the only recompute tried: drop it, or add selective or none "
            "to --recompute"
        )


def check_fp8_arguments(args, given: tuple[str, ...] = ()) -> None:
    """ValueError if --fp8-layers or --fp8-speedup is given (`given`) without --fp8, as
    megapar-train refuses --fp8-layers without it. --fp8 under --precision fp32 is planned as
    megapar-train runs it (it does not refuse it): the linears' inputs fp32, cast to float8."""
    for name in ("fp8_layers", "fp8_speedup"):
        if name in given and args.fp8 == "off":
            raise ValueError(
                f"--{name.replace('_', '-')} applies to --fp8: add --fp8 tensorwise (or "
                f"rowwise) or drop it"
            )


def _no_zero3(args) -> tuple[str, str]:
    """(why the search tries no ZeRO-3 layout, its fix): --gpus 1 (ZeRO-3 is tried only where
    there are dp ranks to shard over), or --zero-stages without 3."""
    if 3 in args.zero_stages:
        return "--gpus 1 has no ZeRO-3 layout", "raise --gpus"
    listed = " ".join(map(str, args.zero_stages))
    return f"--zero-stages {listed} has no 3", "add 3 to --zero-stages"


def vocabulary_kept(args) -> bool:
    """Whether megapar-train's run keeps the vocabulary the plan counts whatever its data's
    tokenizer: --model is a config file that fixes vocab_size (a recipe's, and --vocab-size's,
    the data's tokenizer replaces)."""
    path = os.path.expanduser(args.model)
    if not os.path.exists(path):
        return False
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    try:
        return "vocab_size" in load_config_file(file)
    except (OSError, ValueError):
        return False


def take_vocabulary(args, config) -> None:
    """Give `config` the vocabulary of megapar-train's data tokenizer, as megapar-train gives it
    to a recipe (or to a config file without vocab_size): --tokenizer's size (the tokenizer is
    loaded, nothing tokenized) or --vocab-size N. Padding per layout stays the model's
    (make_vocab_size_divisible_by x tp). ValueError if both are given, N < 1, the tokenizer
    does not load, or --model is a config file whose vocab_size megapar-train keeps (and a
    --tokenizer beside it needs more ids, or --vocab-size is given)."""
    if args.tokenizer is None and args.vocab_size is None:
        return
    if args.tokenizer is not None and args.vocab_size is not None:
        raise ValueError(
            "--tokenizer and --vocab-size both give the data's vocabulary: keep one "
            "(--tokenizer, which the printed megapar-train command carries)"
        )
    if args.vocab_size is not None and vocabulary_kept(args):  # (--model's file: it loads)
        raise ValueError(
            f"--vocab-size {args.vocab_size} sets the data's vocabulary, and the model config "
            f"{args.model} fixes vocab_size {config.vocab_size:,}, which megapar-train keeps: "
            f"drop --vocab-size, or leave vocab_size out of the config to take the tokenizer's"
        )
    if args.vocab_size is not None:
        if args.vocab_size < 1:
            raise ValueError(
                f"--vocab-size {args.vocab_size} is invalid: give the tokenizer's vocabulary, >= 1"
            )
        config.vocab_size = args.vocab_size
        return
    try:
        tokenizer = load_tokenizer(args.tokenizer)
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"--tokenizer {args.tokenizer} does not load: {exc}; or give --vocab-size N"
        ) from None
    if not vocabulary_kept(args):
        config.vocab_size = tokenizer.vocab_size
        return
    needed = model_rows(tokenizer, config.model_type)  # as megapar-train checks it
    if needed > config.vocab_size:
        raise ValueError(
            f"--tokenizer {args.tokenizer} needs {needed:,} token ids, and the model config "
            f"{args.model} fixes vocab_size {config.vocab_size:,}, which megapar-train keeps: "
            f"give a tokenizer of at most {config.vocab_size:,} ids, or leave vocab_size out of "
            f"the config to take the tokenizer's"
        )
