"""megapar-plan: predict memory, bubble, communication and step time of every parallel layout
for N GPUs, rank them, and print the best one's megapar-train command.

    megapar-plan --model gpt2-1.5b --gpus 16 --gpus-per-node 8 --gpu-memory-gb 40 \
        --global-batch-size 512 --seq-len 1024
    megapar-plan --model gpt3-175b.json --gpus 1024 --gpu-memory-gb 80 --global-batch-size 1536 \
        --seq-len 2048 --master-weights separate --top 10
    megapar-plan ... --explain tp=8,pp=16,mbs=1,schedule=1f1b,recompute=full
    megapar-plan ... --json > plan.json

Nothing runs on a GPU: parameters are counted on meta-device models, activations come from
Korthikanti et al. 2022, bubbles from megapar's schedule simulator (or the published formula of
a schedule megapar does not implement yet), communication from byte counts and bandwidths.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys

from megapar.cli.closed_stdout import quiet_when_stdout_closes
from megapar.cli.plan_args import (
    check_fp8_arguments,
    check_layout_arguments,
    check_mode_arguments,
    check_number_arguments,
    check_search_arguments,
    check_split_arguments,
    offload_refused,
    take_vocabulary,
    vocabulary_kept,
)
from megapar.cli.plan_verify import verify_estimates
from megapar.faults.processes import exit_uncollected
from megapar.mesh import Layout
from megapar.models.config import ConfigError
from megapar.models.documents import MASK_TYPES
from megapar.models.recipes import resolve_model
from megapar.one_line_parser import (
    SHARDING_CONFIG_NAMES,
    OneLineParser,
    gib_amount,
    layout_names,
    other_switch_value,
    shown_default,
)
from megapar.optim.optimizer import NOT_OFFLOADED, OPTIMIZERS
from megapar.pipeline.partition import PipelineSplit
from megapar.pipeline.schedules import schedule_named_elsewhere
from megapar.plan import (
    Problem,
    check,
    cycle_collection_paused,
    estimate,
    parse_candidate,
    search,
)
from megapar.plan.layouts import (
    CP_COMMS,
    OFFLOADS,
    PLAN_SCHEDULES,
    RECOMPUTE,
    ZERO_STAGES,
    default_cp_sizes,
    model_refusal,
    pps_the_gpus_take,
    tps_the_gpus_take,
)
from megapar.plan.params import model_params
from megapar.plan.problem import runs_fused_attention
from megapar.plan.process import CUDA_CONTEXT, GIB, TARGETS, describe
from megapar.plan.report import (
    active_note,
    attention_note,
    batch_json,
    command,
    data_note,
    documents_note,
    expert_lines,
    explain,
    fp8_json,
    fp8_lines,
    fp8_note,
    hardware_phrase,
    multinode_note,
    peak_note,
    print_json,
    ranks_phrase,
    row,
    runnable,
    table,
)
from megapar.tensor_parallel.fp8 import FP8_LAYERS, FP8_RECIPES
from megapar.tensor_parallel.linear_cross_entropy import LOSS_CHUNK_TOKENS
from megapar.training.config import TrainConfig
from megapar.training.other_tools import (
    FP8_FILTER,
    FP8_ON,
    FP8_RECIPE,
    MODEL_FIELD,
    MOE_FIELD,
    TORCHTITAN_CONFIG,
)
from megapar.training.usage import flag_of
from megapar.wording import counted


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's help that ends each flag's text with its default, once: not for a required
    flag or one without a default (no "(default: None)"), nor where the text already says its
    default; a list default is written as it is typed (1 2 4 8), a switch's as off / on."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.required or action.default is None or "(default" in text:
            return text
        if isinstance(action.default, list):
            return f"{text} (default: {' '.join(map(str, action.default))})"
        if isinstance(action.default, bool):
            return f"{text} (default: {shown_default(action.default)})"
        return super()._get_help_string(action) or ""


_ONE_LAYOUT = (
    "megapar-plan ranks every layout itself; to check one, give it to --explain "
    "(e.g. --explain tp=2,pp=2,cp=2,mbs=1)"
)

_ONE_SETTING = (
    "megapar-plan tries {what} itself; to check one layout with it, give {key} to --explain "
    "(e.g. --explain {example})"
)

_ONE_EP = _ONE_SETTING.format(
    what="every ep dividing dp x cp and the experts", key="ep=N", example="dp=8,ep=8,mbs=1"
)

_ACCUMULATION = (
    "megapar-plan derives each layout's micro-batches per step from --global-batch-size, its "
    "micro-batch size (--micro-batch-sizes) and its dp; drop it"
)

FP8_ZERO3 = (
    "megapar-plan counts ZeRO-3's float8 all-gather (and its one all-reduce of the weights' "
    "scales a step) for --fp8 tensorwise itself; drop it"
)

GPU_NAME_FLAGS = ("--gpu", "--gpu-type", "--gpu-model")
"""Other tools' flags naming the GPU, which megapar-plan takes as its figures."""

GPU_NUMBERS = frozenset(
    {"1080", "2080", "3060", "3070", "3080", "3090", "4060", "4070", "4080", "4090", "5080"}
    | {"5090", "6000", "8000"}
)
"""GPUs named by a number alone (RTX 4090, RTX 6000): `--gpu 4090` names one, not a count
(it was asked "did you mean --gpus 4090?"; a re-test)."""

GPU_FIGURES = (
    "--gpu-memory-gb and --peak-tflops (the defaults are an 80 GB A100's: 80 and 312; an H100 "
    "SXM's are 80 and 989)"
)
"""The flags that give megapar-plan a GPU, and two GPUs' values of them."""

OTHER_FLAGS = {
    # short names a user tries first (difflib named --zero3-persistence-threshold for --zero3)
    "--zero3": "--zero-stages 3",
    "--bs": "--global-batch-size (and --micro-batch-sizes to search)",
    "--gbs": "--global-batch-size",
    "--mbs": "--micro-batch-sizes",
    "--amp": "--precision bf16 (or fp16)",
    "--mem": "--gpu-memory-gb",
    "--gpu-memory": "--gpu-memory-gb",
    "--sp": _ONE_SETTING.format(
        what="sequence parallelism at every tp > 1", key="sp=1", example="tp=2,sp=1,mbs=1"
    ),
    "--sequence-parallel": _ONE_SETTING.format(
        what="sequence parallelism at every tp > 1", key="sp=1", example="tp=2,sp=1,mbs=1"
    ),
    "--zero": _ONE_SETTING.format(
        what="every ZeRO stage of --zero-stages", key="zero=N", example="dp=8,zero=3,mbs=1"
    ),
    **dict.fromkeys(layout_names("--tp", "--pp"), _ONE_LAYOUT),
    **dict.fromkeys(layout_names("--cp"), "--cp-sizes"),
    "--use-distributed-optimizer": _ONE_SETTING.format(
        what="every ZeRO stage of --zero-stages", key="zero=1", example="dp=8,zero=1,mbs=1"
    ),
    "--num-experts": MOE_FIELD.format(field="num_local_experts (Qwen3-MoE: num_experts)"),
    **dict.fromkeys(
        ("--moe-router-topk", "--moe-top-k", "--num-experts-per-tok"),
        MOE_FIELD.format(field="num_experts_per_tok"),
    ),
    **dict.fromkeys(
        ("--moe-token-dropping", "--moe-expert-capacity-factor", "--moe-capacity-factor"),
        "megapar-plan takes a capacity factor from the model config (moe_capacity_factor), "
        "as the most an expert's tokens can be over its mean share: set it there, or plan "
        "routing's imbalance with --moe-imbalance",
    ),
    "--moe-grouped-gemm": "megapar-train runs the experts as one grouped matmul per projection "
    "by itself (on CUDA in bf16); drop it",
    **dict.fromkeys(layout_names("--ep"), _ONE_EP),
    **layout_names("--virtual-stages"),
    "--tp": _ONE_LAYOUT,
    "--pp": _ONE_LAYOUT,
    "--dp": _ONE_LAYOUT,
    "--ep": _ONE_EP,
    "--cp": "--cp-sizes",
    "--world-size": "--gpus",
    "--num-gpus": "--gpus",
    "--nodes": "--gpus (all of them) and --gpus-per-node",
    "--data": "megapar-plan reads no data: drop it, and give the data's tokenizer as "
    "megapar-train takes it (--tokenizer SPEC, or --vocab-size N) for its vocabulary",
    "--make-vocab-size-divisible-by": MODEL_FIELD.format(field="make_vocab_size_divisible_by"),
    # DeepSpeed's and megapar-train's names: difflib named --fp8 for --fp16, --micro-batch-sizes
    # for --train-batch-size (the global batch), or nothing
    "--fp16": "--precision fp16",
    "--bf16": "--precision bf16",
    "--train-batch-size": "--global-batch-size",
    "--train_batch_size": "--global-batch-size",
    "--train-micro-batch-size-per-gpu": "--micro-batch-sizes",
    "--train_micro_batch_size_per_gpu": "--micro-batch-sizes",
    "--gradient-accumulation-steps": _ACCUMULATION,
    "--gradient_accumulation_steps": _ACCUMULATION,
    "--grad-accumulation-steps": _ACCUMULATION,
    "--grad_accumulation_steps": _ACCUMULATION,
    "--accumulate-grad-batches": _ACCUMULATION,
    **dict.fromkeys(
        (
            "--stage",
            "--zero-stage",
            "--zero_stage",
            "--zero_optimization",
            "--zero_optimization.stage",
        ),
        _ONE_SETTING.format(
            what="every ZeRO stage of --zero-stages", key="zero=N", example="dp=8,zero=3,mbs=1"
        ),
    ),
    **dict.fromkeys(
        SHARDING_CONFIG_NAMES,
        "megapar-plan tries every ZeRO stage of --zero-stages (FSDP's full_shard is zero 3, "
        "shard_grad_op zero 2, DeepSpeed's stages the same numbers) and reads no FSDP or "
        "DeepSpeed config; drop it",
    ),
    "--module": TORCHTITAN_CONFIG.format(
        examples="",
        tool="megapar-plan",
        instead="give the model as --model (a recipe such as llama-8b)",
    ),
    **dict.fromkeys(
        GPU_NAME_FLAGS, f"megapar-plan takes a GPU's figures, not its name: {GPU_FIGURES}"
    ),
    "--offload-optimizer": "--offload optimizer",
    "--offload-params": "--offload both",
    "--offload_param": "--offload both",
    **dict.fromkeys(
        (
            "--checkpoint-activations",
            "--checkpoint_activations",
            "--gradient-checkpointing",
            "--activation-checkpointing",
        ),
        "--recompute full",
    ),
    # megapar-train's float8 and compile flags, torchtitan's names for them: difflib named
    # --fp8-layers for --fp8-emulate and --recompute for --compile, or nothing
    "--fp8-emulate": "megapar-plan plans the job's GPUs, whose float8 products are real "
    "(megapar-train --dry-run emulates them on this CPU); drop it",
    "--compile": "megapar-plan plans eager blocks; megapar-train --dry-run --compile plans a "
    "job with compiled blocks",
    "--float8": FP8_ON,
    "--model.converters": FP8_ON,
    "--float8.recipe_name": FP8_RECIPE,
    "--quantize.linear.float8.recipe_name": FP8_RECIPE,
    "--float8.filter_fqns": FP8_FILTER,
    "--quantize.linear.float8.filter_fqns": FP8_FILTER,
    "--float8.enable_fsdp_float8_all_gather": FP8_ZERO3,
    "--quantize.linear.float8.enable_fsdp_float8_all_gather": FP8_ZERO3,
    "--float8.precompute_float8_dynamic_scale_for_fsdp": FP8_ZERO3,
    "--quantize.linear.float8.precompute_float8_dynamic_scale_for_fsdp": FP8_ZERO3,
}
"""megapar-train's layout flags, Megatron-LM's names for them, and other names, answered with
megapar-plan's way (difflib named `--top` for `--tp`, `--pp`, `--dp`, `--cp` and `--sp`,
`--zero-stages` for `--zero`, `--today` for `--data`)."""


def schedule_to_rank(value: str) -> str:
    """For a `--schedules` value megapar-plan does not take but another tool or paper names
    (`ScheduleInterleaved1F1B`, `ZB-H1`), megapar's name for it in megapar-plan's flags ("'ZB-H1'
    is megapar's --schedules zb-h1"); "" for a name `schedule_named_elsewhere` does not know."""
    return schedule_named_elsewhere(value).replace("--schedule ", "--schedules ")


def answer_with_value(flag: str, text: str, given: frozenset[str] = frozenset()) -> str | None:
    """The answer to another tool's flag given a value on megapar-plan's line: a count given to
    a GPU's name (`--gpu 2`: --gpus 2; it was told --gpu-memory-gb and --peak-tflops) where the
    line's flags (`given`) lack --gpus, or a switch given false (`switch_given_false`); None
    where the flag's own answer stands."""
    count = text.strip()
    counted = count.isdigit() and int(count) and count not in GPU_NUMBERS
    if flag in GPU_NAME_FLAGS and counted and "--gpus" not in given:  # (asked beside --gpus 8)
        kind = "a GPU's kind is --gpu-memory-gb and --peak-tflops"
        return f"did you mean --gpus {count}? ({kind})"
    return switch_given_false(flag, text)


def switch_given_false(flag: str, text: str) -> str | None:
    """The answer to another tool's switch given false on megapar-plan's line (`--bf16 0`,
    `--gradient_checkpointing=False`, `--no-bf16`), `FALSE_ANSWERS`' for its `OTHER_FLAGS`
    answer (bf16's false is fp32, megapar-plan counting bf16 by default: `--bf16 0` was told
    --precision bf16); None for a true value or no true / false, whose answer is the flag's
    own."""
    named = flag if flag in OTHER_FLAGS else "--" + flag[2:].replace("_", "-")
    ours = OTHER_FLAGS.get(named, "")
    if other_switch_value(text) is not False or ours not in FALSE_ANSWERS:
        return None
    return FALSE_ANSWERS[ours]


FALSE_ANSWERS = {
    "--precision bf16": "false counts fp32 activations: --precision fp32 (megapar-plan counts "
    "bf16 by default)",
    "--precision fp16": "false asks for no fp16: leave the flag out (megapar-plan counts bf16 "
    "by default)",
    "--recompute full": "false plans no recomputation: --recompute none",
    "--zero-stages 3": "false plans no ZeRO-3: --zero-stages 0 1 2",
    "--offload optimizer": "false plans no offload, as megapar-plan does by default: leave the "
    "flag out",
    "--offload both": "false plans no offload, as megapar-plan does by default: leave the flag out",
}
"""megapar-plan's answers to another tool's switch given false (`switch_given_false`), by
`OTHER_FLAGS`' answer to its true."""


def build_parser() -> OneLineParser:
    """megapar-plan's argument parser, its flags grouped by concern."""
    p = OneLineParser(
        prog="megapar-plan",
        stray=(("--model", "the model"),),
        known_as=OTHER_FLAGS,
        switch_known_as=lambda flag, text: answer_with_value(flag, text, p.given_flags),
        value_known_as={"--schedules": schedule_to_rank},
        description=__doc__.split("\n")[0],
        formatter_class=DefaultsHelpFormatter,
    )
    add_job_arguments(p)
    add_precision_arguments(p)
    add_hardware_arguments(p)
    add_search_arguments(p)
    add_output_arguments(p)
    return p


def add_job_arguments(p: argparse.ArgumentParser) -> None:
    """The job planned for: the model, the GPUs and the batch."""
    p.add_argument("--model", required=True, help="model recipe (models/) or JSON/YAML config")
    p.add_argument("--gpus", type=int, required=True, help="total GPUs N")
    p.add_argument("--gpus-per-node", type=int, default=8, help="tp stays within a node")
    p.add_argument(
        "--gpu-memory-gb", type=gib_amount, default=80.0, help="memory per GPU, GiB (80 or 80GB)"
    )
    p.add_argument(
        "--global-batch-size",
        type=int,
        default=None,
        help=f"sequences per step (default: megapar-train's, {TrainConfig.global_batch_size}, "
        f"which the header then names)",
    )
    p.add_argument(
        "--seq-len",
        type=int,
        required=True,
        help="tokens per sequence (required, unlike --global-batch-size: activations grow with it, "
        "and megapar-train's default, 128 tokens, is a smoke test's length)",
    )
    p.add_argument(
        "--attention-mask-type",
        choices=list(MASK_TYPES),
        default="causal",
        help="megapar-train's --attention-mask-type: block_causal counts the additive mask "
        "(micro-batch x seq-len x seq-len in the activation dtype) each model chunk makes per "
        "micro-batch and sliding window and keeps until the backward",
    )
    p.add_argument(
        "--tokenizer",
        metavar="SPEC",
        default=None,
        help="the tokenizer of megapar-train's --data (its --tokenizer: gpt2, a tokenizer.json "
        "directory, a .model file, ...): a recipe's vocabulary becomes this tokenizer's, as in "
        "megapar-train (only its size is read; the command carries it); default: the recipe's "
        "own vocabulary",
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        metavar="N",
        help="the data's tokenizer's vocabulary, given as a number instead of --tokenizer "
        "(Megatron-LM's name); padded per layout to a multiple of the model's "
        "make_vocab_size_divisible_by x tp, as megapar-train pads it",
    )


def add_precision_arguments(p: argparse.ArgumentParser) -> None:
    """How the bytes are counted: activation precision, master weights, fused attention."""
    p.add_argument(
        "--precision",
        choices=["fp32", "bf16", "fp16"],
        default="bf16",
        help="activations in 4 (fp32) or 2 bytes",
    )
    p.add_argument(
        "--master-weights",
        choices=["fp32", "separate"],
        default="fp32",
        help="fp32: megapar today (fp32 params, grads, Adam: 16 B/param); separate: "
        "16-bit params + fp32 grads, master and moments (Megatron: 18 B/param)",
    )
    p.add_argument(
        "--optimizer",
        choices=list(OPTIMIZERS),
        default="adamw",
        help="the optimizer state counted, as megapar-train --optimizer holds it: adamw and "
        "lamb (two fp32 moments and a step count per parameter), sgd and lars (one fp32 "
        "momentum buffer per parameter, no step count) or muon (one fp32 momentum buffer for "
        "the blocks' 2-D weights, AdamW's state for the rest)",
    )
    p.add_argument(
        "--fused-attention",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="count what a fused attention kernel keeps (a log-sum-exp, no a*s^2 "
        "scores): what megapar-train runs on GPUs, and on CPU ranks without attention "
        "dropout; --no-fused-attention counts the scores, softmax and dropout mask (the "
        "paper; megapar-train on a CPU with attention dropout) (default: as megapar-train "
        "runs on the --target)",
    )
    p.add_argument(
        "--loss-chunk-tokens",
        type=int,
        default=LOSS_CHUNK_TOKENS,
        help="megapar-train's --loss-chunk-tokens: the LM head and loss this many tokens at "
        "a time (0: the whole logits)",
    )
    p.add_argument(
        "--moe-imbalance",
        type=float,
        default=None,
        help="mixture of experts under ep: the busiest rank's routed rows over the mean, "
        "which scales its experts' activations (default: the model's capacity factor, or "
        "1.25 when dropless)",
    )
    p.add_argument(
        "--sp-regather",
        action="store_true",
        help="megapar-train's --sp-regather for the layouts with sequence parallelism: "
        "the column-parallel inputs kept as sequence slices (1/tp) and all-gathered again "
        "in the backward (not under full recompute or a zero-bubble schedule)",
    )
    p.add_argument(
        "--decoder-first-pipeline-num-layers",
        type=int,
        default=None,
        help="megapar-train's --decoder-first-pipeline-num-layers: the blocks of the first "
        "stage (with several chunks per rank, of the model's first chunk), the rest cut "
        "evenly over the other stages or chunks; layouts that cannot take it are rejected",
    )
    p.add_argument(
        "--decoder-last-pipeline-num-layers",
        type=int,
        default=None,
        help="megapar-train's --decoder-last-pipeline-num-layers: the blocks of the last "
        "stage (or the model's last chunk), as --decoder-first-pipeline-num-layers",
    )
    p.add_argument(
        "--account-for-embedding-in-pipeline-split",
        action="store_true",
        help="megapar-train's --account-for-embedding-in-pipeline-split: the embedding "
        "counted as one block when the blocks are cut evenly into stages or chunks",
    )
    p.add_argument(
        "--account-for-loss-in-pipeline-split",
        action="store_true",
        help="megapar-train's --account-for-loss-in-pipeline-split: the head and loss "
        "counted as one block when the blocks are cut evenly into stages or chunks",
    )
    p.add_argument(
        "--fp8",
        choices=FP8_RECIPES,
        default="off",
        help="megapar-train's --fp8: the block linears that torchao's size rule converts at "
        "every layout (by their whole N x K) run their products at --fp8-speedup x the rate, "
        "with their amax all-reduces; autocast keeps no 16-bit copy of their weights and "
        "their casts' transients are counted",
    )
    p.add_argument(
        "--fp8-layers",
        choices=FP8_LAYERS,
        default="auto",
        help="megapar-train's --fp8-layers: auto (torchao's size rule on each layer's whole "
        "N x K) or all (every block linear whose dims are multiples of 16); a layout whose tp "
        "splits a chosen one into shards that are not multiples of 16 is refused",
    )
    p.add_argument(
        "--target",
        type=_target,
        choices=TARGETS,
        default="gpu",
        help="what the memory figure is for: gpu (the tensors' peak, the caching "
        "allocator's reserve and the CUDA context) or cpu (megapar-train on CPU ranks: the "
        "heap's room and the runtime, the process's baseline apart)",
    )


def _target(word: str) -> str:
    """--target's value: gpu or cpu; a GPU's or a device's name (h100, cuda) refused naming the
    flags that give a GPU's figures."""
    if word in TARGETS:
        return word
    raise argparse.ArgumentTypeError(
        f"{word!r} is not one of {', '.join(TARGETS)}: --target gpu plans any GPU, whose "
        f"figures are --gpu-memory-gb and --peak-tflops (the defaults are an 80 GB A100's: 80 "
        f"and 312; an H100 SXM's are 80 and 989)"
    )


def add_hardware_arguments(p: argparse.ArgumentParser) -> None:
    """The GPUs' speed and the links' bandwidths and latency."""
    p.add_argument("--peak-tflops", type=float, default=312.0, help="per GPU (A100 bf16: 312)")
    p.add_argument("--efficiency", type=float, default=0.6, help="share of peak matmuls reach")
    p.add_argument("--intra-node-gbps", type=float, default=2400.0, help="per GPU, Gbit/s")
    p.add_argument("--inter-node-gbps", type=float, default=200.0, help="per GPU, Gbit/s")
    p.add_argument("--latency-us", type=float, default=10.0, help="per message of a collective")
    p.add_argument(
        "--fp8-speedup",
        type=float,
        default=2.0,
        help="with --fp8: float8 matmuls' peak over --peak-tflops (H100 / H200 dense: "
        "1979 / 989); the casts' memory traffic is not modelled (an upper bound)",
    )


def add_search_arguments(p: argparse.ArgumentParser) -> None:
    """The layouts tried: micro-batch sizes, schedules, recompute, ZeRO, offload, cp sizes."""
    p.add_argument(
        "--micro-batch-sizes",
        type=int,
        nargs="+",
        default=[1, 2, 4, 8],
        help="micro-batch sizes tried (sequences per micro-batch)",
    )
    p.add_argument(
        "--schedules",
        nargs="+",
        choices=PLAN_SCHEDULES,
        default=list(PLAN_SCHEDULES),
        help="pipeline schedules tried where pp > 1",
    )
    p.add_argument(
        "--virtual-stages",
        type=int,
        nargs="+",
        default=[2, 4],
        help="chunks per rank tried for the interleaved schedule",
    )
    p.add_argument(
        "--recompute",
        nargs="+",
        choices=RECOMPUTE,
        default=list(RECOMPUTE),
        help="activation recomputation modes tried (megapar-train's --recompute)",
    )
    p.add_argument(
        "--zero-stages",
        type=int,
        nargs="+",
        choices=ZERO_STAGES,
        default=list(ZERO_STAGES),
        help="ZeRO stages tried where dp x cp > 1 (1: optimizer state sharded, 2: "
        "also gradients, 3: also parameters)",
    )
    p.add_argument(
        "--offload",
        nargs="+",
        choices=OFFLOADS,
        default=["none"],
        help="host-memory offloads tried, a list as --zero-stages: none, optimizer "
        "(--offload-optimizer), both (ZeRO-3: also --offload-params, the parameter shards); "
        "the list replaces the default, so give none optimizer to compare offloading with not",
    )
    p.add_argument(
        "--pcie-gbps",
        type=float,
        default=200.0,
        help="host-device bandwidth per GPU, Gbit/s (offload's copies)",
    )
    p.add_argument(
        "--zero3-persistence-threshold",
        type=int,
        default=0,
        help="megapar-train's --zero3-persistence-threshold for the ZeRO-3 layouts: "
        "parameters with fewer elements form one unit gathered once a step "
        "(0: none)",
    )
    p.add_argument(
        "--cp-sizes",
        type=int,
        nargs="+",
        default=None,
        help="context-parallel sizes tried (default: 1, and 2 4 8 too when --seq-len "
        "is 8192 or more)",
    )
    p.add_argument(
        "--cp-comm-type",
        choices=CP_COMMS,
        default=None,
        help="megapar-train's --cp-comm-type for the layouts at cp > 1: auto (the model's "
        "own: a ring of K/V blocks, an all-gather of them for grouped-query heads), p2p "
        "(ring), all_gather, a2a (all-to-all, Ulysses); default: auto, p2p where auto "
        "is the all-gather, and a2a where a tp rank's query heads divide over cp, all tried",
    )
    p.add_argument(
        "--expert-tensor-parallel-size",
        type=int,
        default=None,
        metavar="N",
        help="megapar-train's --expert-tensor-parallel-size for a mixture of experts: 1 "
        "(each routed expert whole on every tp rank) or N = tp (each split over tp: only "
        "layouts at tp N); default: 1 and tp both tried",
    )
    p.add_argument(
        "--today",
        action="store_true",
        help="only layouts megapar-train runs as planned now (fp32 master weights; "
        "no schedule or feature it lacks)",
    )


def add_output_arguments(p: argparse.ArgumentParser) -> None:
    """What is printed: the table's rows, one layout explained, JSON, dry-run verification."""
    p.add_argument("--top", type=int, default=15, help="rows of the ranked table")
    p.add_argument(
        "--explain",
        metavar="LAYOUT",
        help="check and break down one layout, e.g. tp=2,pp=4,mbs=2,schedule=1f1b,"
        "recompute=selective,sp=1,zero=1,cp=2, or its name as the table prints it "
        "('tp2 cp2 pp4 mbs2 1f1b rc=selective sp zero1') (dp defaults to gpus/(tp*cp*pp))",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument(
        "--verify",
        type=int,
        default=0,
        metavar="K",
        help="dry-run the K best layouts (megapar-train --dry-run, on this CPU) and "
        "report every rank whose planned weights, gradients or optimizer bytes "
        "differ from the real tensors' (exit code 1 if any do)",
    )


def _problem(args, given: tuple[str, ...] = ()):
    """The `Problem` the arguments describe; ValueError naming the flag if one is invalid
    (`given`: the options the command line sets, `OneLineParser.given`)."""
    config = resolve_model(args.model)
    args.batch_assumed = args.global_batch_size is None
    if args.batch_assumed:
        args.global_batch_size = TrainConfig.global_batch_size
    take_vocabulary(args, config)
    # the config's own errors (biases, rope type, kv heads, a hidden size the heads do not
    # divide) hold at every layout: at one GPU's layout only they can fail
    config.validate(Layout(1, 1, 1))
    if args.attention_mask_type == "block_causal" and config.model_type == "bert":
        raise ValueError(  # as megapar-train refuses it (`check_documents`)
            "--attention-mask-type block_causal reads the documents packed into a decoder's "
            "sequences, and BERT's samples are one sentence pair each; drop it or plan GPT-2 "
            "or a Llama-family model"
        )
    limit = config.max_positions
    if args.seq_len > limit:  # the config's own name for its positions
        key = "n_positions" if hasattr(config, "n_positions") else "max_position_embeddings"
        raise ValueError(
            f"--seq-len {args.seq_len} is longer than the model's {limit} positions; give "
            f"--seq-len {limit} or less, or a config file whose {key} reaches {args.seq_len}"
        )
    check_layout_arguments(args)
    check_number_arguments(args)
    check_mode_arguments(args)
    check_search_arguments(args, config, given)
    check_fp8_arguments(args, given)
    split = PipelineSplit(
        args.decoder_first_pipeline_num_layers,
        args.decoder_last_pipeline_num_layers,
        args.account_for_embedding_in_pipeline_split,
        args.account_for_loss_in_pipeline_split,
    )
    split.check(2)  # its own errors; each layout's pp and layers are checked with it
    if args.explain is None:
        check_split_arguments(args, config, split)
    return Problem(
        config,
        args.gpus,
        args.gpus_per_node,
        args.gpu_memory_gb,
        args.global_batch_size,
        args.seq_len,
        args.precision,
        args.master_weights,
        runs_fused_attention(config, args.target)
        if args.fused_attention is None
        else args.fused_attention,
        args.peak_tflops,
        args.efficiency,
        args.intra_node_gbps,
        args.inter_node_gbps,
        args.latency_us,
        pcie_gbps=args.pcie_gbps,
        zero3_persistence_threshold=args.zero3_persistence_threshold,
        loss_chunk_tokens=args.loss_chunk_tokens,
        moe_imbalance=args.moe_imbalance,
        sp_regather=args.sp_regather,
        pipeline_split=split,
        target=args.target,
        fp8=args.fp8,
        fp8_layers=args.fp8_layers,
        fp8_speedup=args.fp8_speedup,
        optimizer=args.optimizer,
        attention_mask_type=args.attention_mask_type,
        tokenizer=args.tokenizer,
        vocabulary_kept=vocabulary_kept(args),
    )


BATCH_ASSUMED = (
    " (megapar-train's default --global-batch-size, assumed as none was given; give the run's own)"
)
"""What the header adds where --global-batch-size was not given."""


SEARCH_OPTIONS = (
    "micro_batch_sizes",
    "schedules",
    "virtual_stages",
    "recompute",
    "zero_stages",
    "offload",
    "cp_sizes",
    "cp_comm_type",
    "expert_tensor_parallel_size",
    "today",
    "top",
)
"""The options that shape the search and its table, which --explain (one layout) does not run."""


def _refuse_search_flags(given: tuple[str, ...]) -> None:
    """ValueError naming the search's options given with --explain (`given`:
    `OneLineParser.given`): they would be ignored (the layout's own settings are the LAYOUT's
    keys)."""
    named = sorted(flag_of(name) for name in given if name in SEARCH_OPTIONS)
    if named:
        raise ValueError(
            f"{', '.join(named)} {'shapes' if len(named) == 1 else 'shape'} the search, which "
            f"--explain does not run (it estimates the one LAYOUT it names); drop "
            f"{'it' if len(named) == 1 else 'them'}, or give the setting in LAYOUT (e.g. "
            f"mbs=2,schedule=1f1b,recompute=full,zero=1,cp=2,offload=optimizer,"
            f"cp_comm=a2a,etp=2)"
        )


def _explain(args, problem) -> int:
    c = parse_candidate(args.explain, problem.gpus)
    if c.zero not in ZERO_STAGES:  # a bad value (exit 2), not a layout that cannot run
        raise ValueError(f"--explain: zero={c.zero}: use one of {', '.join(map(str, ZERO_STAGES))}")
    if c.offload_optimizer and problem.optimizer in NOT_OFFLOADED:
        raise ValueError(offload_refused(f"--explain offload={c.offloaded()}", problem.optimizer))
    batch = batch_json(problem, getattr(args, "batch_assumed", False))
    reason = check(c, problem)
    model = model_refusal(dataclasses.replace(c, dp=max(c.dp, 1)), problem.config)
    if reason and model and reason.endswith(model):  # the model's: the tp --gpus takes too
        reason += tps_the_gpus_take(c, problem) + pps_the_gpus_take(c, problem)
    if reason:
        if args.json:
            print(json.dumps({"layout": c.label(), "valid": False, "reason": reason, **batch}))
        else:
            print(f"{c.label()}: invalid: {reason}")
        return 1
    with cycle_collection_paused():
        e = estimate(problem, c)
    cmd, missing = command(e, problem, args.model)
    if args.json:
        print(
            json.dumps(
                {
                    **row(e, problem.master_weights),
                    "valid": True,
                    **batch,
                    "command": cmd,
                    "fused_attention": problem.fused_attention,
                    "sp_regather": problem.sp_regather,
                    **fp8_json(problem, e),
                },
                indent=1,
            )
        )
        return 0
    if getattr(args, "batch_assumed", False):
        print(f"global batch {problem.global_batch} sequences{BATCH_ASSUMED}")
    print(
        "\n".join([explain(e, problem.target), *expert_lines(e, problem), *fp8_lines(e, problem)])
    )
    print(attention_note(problem))
    for note in (documents_note(problem), fp8_note(problem), peak_note(problem)):
        if note:
            print(note)
    if e.process is not None:
        print(describe(e.process))
    print(f"command: {cmd}")
    print(data_note(problem))
    if launch := multinode_note(problem):
        print(launch)
    for m in missing:
        print(f"  note: megapar-train cannot do this yet: {m}")
    return 0


def _model_first(argv) -> str | None:
    """The refusal of a --model that names no recipe and no file, or None: said before the
    parser asks for a missing flag (`--model gtp2-124m` was asked for --seq-len, then told
    the name was unknown)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--model")
    pre.add_argument("-h", "--help", action="store_true")
    known = pre.parse_known_args(argv)[0]
    name = known.model
    if known.help or not name or os.path.exists(os.path.expanduser(name)):
        return None  # --help is answered first
    try:
        resolve_model(name)
    except ConfigError as exc:
        return str(exc)
    return None


@quiet_when_stdout_closes
def main(argv=None) -> int:
    exit_uncollected()  # torch's heap left to the OS at exit
    parser = build_parser()
    refusal = _model_first(argv)
    if refusal is not None:
        print(f"megapar-plan: error: {refusal}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    try:
        given = parser.given(argv)
        if args.explain is not None:  # --explain '' too: refused, not the whole search
            _refuse_search_flags(given)
        problem = _problem(args, given)
        if args.explain is not None:
            return _explain(args, problem)
    except (ConfigError, ValueError) as exc:
        print(f"megapar-plan: error: {exc}", file=sys.stderr)
        return 2

    # the rows read from the top of the ranking: a layout that cannot fit is dropped unless
    # fewer fit (`plan.search`); with --today the count of layouts is of those it keeps, and
    # a negative --top shows all but the last rows: every layout estimated
    shown = max(args.top, args.verify, 1) if min(args.top, args.verify) >= 0 else None
    found = search(
        problem,
        shown=None if args.today else shown,
        micro_batch_sizes=tuple(args.micro_batch_sizes),
        schedules=tuple(args.schedules),
        virtual_stages=tuple(args.virtual_stages),
        recompute=tuple(args.recompute),
        cp_sizes=tuple(args.cp_sizes) if args.cp_sizes else None,
        zero_stages=tuple(args.zero_stages),
        offloads=tuple(args.offload),
        etp=args.expert_tensor_parallel_size,
        cp_comm=args.cp_comm_type,
    )
    estimates, rejected, valid = found.estimates, found.rejected, found.valid
    if args.today:
        estimates = [e for e in estimates if not runnable(e, problem.master_weights)]
        valid = len(estimates)
    best = estimates[0] if estimates and estimates[0].fits else None
    cmd = command(best, problem, args.model) if best else None
    if args.json:
        assumed = getattr(args, "batch_assumed", False)
        no_fit = no_fit_line(args, problem.target, estimates) if estimates and not best else None
        print_json(
            args.top, problem, estimates, rejected, cmd, valid, batch_assumed=assumed, no_fit=no_fit
        )
        return 0 if best else 1
    print(
        f"{args.model}: {model_params(problem.config) / 1e6:,.1f}M parameters"
        f"{active_note(problem.config)}; "
        f"{ranks_phrase(problem.gpus, problem.target)} ({problem.gpus_per_node} per node; "
        f"{hardware_phrase(problem)}); global batch "
        f"{problem.global_batch} x {problem.seq_len} tokens"
        f"{BATCH_ASSUMED if getattr(args, 'batch_assumed', False) else ''}; "
        f"{counted(valid, 'valid layout')}, "
        f"{len(rejected):,} rejected"
    )
    if not estimates:  # the reason, without an empty table and its notes
        return _no_valid_layout(args, problem, rejected)
    print(table(estimates[: args.top], problem.master_weights, problem.target))
    print(attention_note(problem))
    for note in (documents_note(problem), fp8_note(problem), peak_note(problem)):
        if note:
            print(note)
    if best is None:
        return _no_fit(args, problem.target, estimates)
    assert cmd is not None  # made for the best layout
    if best.process is not None:
        print(describe(best.process))
    print(
        "\n".join([f"\nchosen: {best.candidate.label()}", *expert_lines(best, problem, estimates)])
    )
    print(f"command: {cmd[0]}")
    print(data_note(problem))
    if launch := multinode_note(problem):
        print(launch)
    for m in cmd[1]:
        print(
            f"  note: megapar-train cannot do this yet: {m} (plan with --today for a layout "
            f"it runs now)"
        )
    return verify_estimates(estimates[: args.verify], problem) if args.verify else 0


def _no_valid_layout(args, problem, rejected) -> int:
    """Say why no layout is valid (the commonest reasons, or the inputs that left nothing to
    try); exit code 1."""
    # what stops the layouts the model itself allows (tp dividing its heads, ...) is what
    # the user can change; the same reason for other sizes counts as one kind
    allowed = [r for c, r in rejected if model_refusal(c, problem.config) is None]
    kinds: dict[str, list] = {}
    for reason in allowed or [r for _, r in rejected]:
        kind = kinds.setdefault(
            re.sub(r"\d+", "N", reason.split(";")[0]), [0, reason.split(";")[0]]
        )
        kind[0] += 1
    common = sorted(kinds.values(), key=lambda kv: -kv[0])[:3]
    if not common:  # nothing was even tried: say which inputs left nothing
        print(
            f"no valid layout: no split of --gpus {problem.gpus} into tp x cp x pp x dp "
            f"was left to try with --cp-sizes {' '.join(map(str, args.cp_sizes or [1]))}; "
            f"give sizes that divide --gpus"
        )
        return 1
    fix = (
        "; give a --global-batch-size that the dp size wanted divides (each dp rank takes "
        "its share of it)"
        + (
            ", --micro-batch-sizes that divide each rank's share"
            if "micro-batch size" in common[0][1]
            else ""
        )
        + ", or fewer --gpus"
        if common[0][1].startswith("global batch ")
        else ""
    )
    print(
        "no valid layout; most common reasons: "
        + "; ".join(
            f"{example} ({n:,} layout{'s' if n > 1 else ''} like it)" for n, example in common
        )
        + fix
    )
    return 1


def _no_fit(args, target: str, estimates: list | None = None) -> int:
    """Say what would make a layout fit the memory (`no_fit_line`); exit code 1."""
    print(no_fit_line(args, target, estimates))
    return 1


def no_fit_line(args, target: str, estimates: list | None = None) -> str:
    """What would make a layout fit the memory. Where the state alone (parameters, gradients,
    optimizer state) of the least loaded layout estimated is more than the memory, only more
    GPUs or more memory can help: said with the fewest GPUs that could hold it (the state
    shrinks at most in proportion to them)."""
    if target == "gpu" and args.gpu_memory_gb * GIB <= CUDA_CONTEXT:  # no split can help
        return (
            f"no layout fits: --gpu-memory-gb {args.gpu_memory_gb:g} is no more than the "
            f"{CUDA_CONTEXT / GIB:g} GiB CUDA context each process holds before any tensor; "
            f"give the GPU's memory (e.g. 80 for an H100)"
        )
    usable = args.gpu_memory_gb * GIB - (CUDA_CONTEXT if target == "gpu" else 0)
    lightest = min(estimates or [], key=lambda e: _state_bytes(e.memory), default=None)
    if lightest is not None and _state_bytes(lightest.memory) > usable:
        state = _state_bytes(lightest.memory)
        per_node = args.gpus_per_node
        fewest = -(-math.ceil(args.gpus * state / usable) // per_node) * per_node
        return (
            f"no layout fits: the parameters, gradients and optimizer state alone need "
            f"{state / GIB:.1f} GiB a {'GPU' if target == 'gpu' else 'rank'} on the least "
            f"loaded layout ({lightest.candidate.label()}), more than the "
            f"{usable / GIB:.1f} GiB it has for tensors, so recomputation, context parallelism "
            f"or a shorter --seq-len cannot help; give --gpus {fewest} or more (the state "
            f"shrinks at most in proportion), or more --gpu-memory-gb"
        )
    fixes = ["raise --gpus or --gpu-memory-gb"]
    if "full" not in args.recompute:
        fixes.append("add --recompute full")
    tried = args.cp_sizes or default_cp_sizes(args.seq_len)
    sizes = [cp for cp in (1, 2, 4, 8) if args.gpus % cp == 0 and args.seq_len % (2 * cp) == 0]
    if max(tried) == 1 and len(sizes) > 1:  # cp sizes the search could try and did not
        fixes.append(f"try context parallelism (--cp-sizes {' '.join(map(str, sizes))})")
    return f"no layout fits: {', '.join(fixes)}, or shorten --seq-len"


def _state_bytes(m) -> float:
    """A layout's device bytes for parameters, gradients and optimizer state at its peak
    (ZeRO-3's gathered units and full gradient buffers with them; offloaded bytes left out)."""
    return m.params + m.grads + m.optimizer + m.master + m.gathered + m.grad_buffers - m.host


if __name__ == "__main__":
    sys.exit(main())
