"""TrainConfig: every setting of a training run, one field per `megapar-train` flag.

The command-line parser is generated from these fields (the flag is the field name with dashes,
the help is the field's docstring), and a `--config FILE` (JSON or YAML) uses the same names,
so there is one list of settings and nothing to keep in step by hand.

The fields are grouped by concern (`GROUPS`): a ``# --- group ---`` line in the class body opens
each group, and `--help` and docs/reference/cli.md list the flags group by group. The groups
only order and label the flags: a `TrainConfig` stays flat (`cfg.zero`, `TrainConfig(lr=...)`).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import functools
import inspect
import os
import re
import shlex
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from megapar.data_parallel.compression import GRAD_COMPRESSIONS
from megapar.data_parallel.sharded_params import REDUCES as ZERO3_REDUCES
from megapar.env_seconds import TIMEOUT_ENV, env_seconds
from megapar.mesh import RANK_ORDERS
from megapar.models.blocks import CP_COMM_TYPES, RECOMPUTE_MODES
from megapar.models.config import ConfigError, load_config_file
from megapar.models.documents import MASK_TYPES
from megapar.one_line_parser import (
    OneLineParser,
    gib_amount,
    other_switch_value,
    shown_default,
)
from megapar.optim.muon import ADJUST_LR
from megapar.optim.optimizer import OPTIMIZERS, optimizer_named_elsewhere
from megapar.optim.precision import COMM_DTYPES, PRECISIONS
from megapar.optim.scheduler import DECAY_STYLES, WSD_STYLES, decay_named_elsewhere
from megapar.pipeline.partition import PipelineSplit
from megapar.pipeline.schedules import SCHEDULES, schedule_named_elsewhere
from megapar.tensor_parallel.cross_entropy import LOSS_MEANS
from megapar.tensor_parallel.fp8 import FP8_LAYERS, FP8_RECIPES
from megapar.training.deepspeed_config import (
    DEEPSPEED_BATCH,
    deepspeed_equivalents,
    is_deepspeed_config,
)
from megapar.training.empty_values import check_empty
from megapar.training.hf_trainer_config import (
    accelerate_config,
    batch_words,
    command_line_wins,
    is_accelerate_config,
    is_trainer_arguments,
    refused_value,
    trainer_arguments,
)
from megapar.training.line_over_file import (
    DEEPSPEED_KEYS,
    TRAINER_KEYS,
    at_the_line,
    get_in,
    trainer_at_lr,
)
from megapar.training.other_tools import (
    OFF_VALUES,
    OTHER_TOOLS_FLAGS,
    TORCHTITAN_MODULE,
    answers_a_switch,
    megatron_defaults,
    other_tools_answer,
    reports_nowhere,
    switch_answer,
)
from megapar.training.ranges import check_ranges
from megapar.training.torchtitan_config import TORCHTITAN_SECTIONS, toml_job_config, torchtitan_job
from megapar.training.usage import UsageError, flag_of, flag_with_value
from megapar.wording import or_list

GROUPS = {
    "layout": "layout (how the ranks split the model and the data)",
    "model": "model (what is trained, in which precision, with which recomputation)",
    "data": "data (the corpus, its tokenization and the batch)",
    "schedule": "pipeline schedule (the order of micro-batches, the messages between stages)",
    "zero": "ZeRO and the data-parallel gradient reduction",
    "optimizer": "optimizer (the update, the learning-rate schedule, the run's length)",
    "checkpoint": "checkpoints (saving and resuming)",
    "logging": "evaluation, logging and profiling",
    "faults": "faults and clean stops (timeouts, non-finite steps, stop signals, slow ranks)",
    "debug": "debugging (step record and replay, testing tools, the dry run)",
}
"""The groups of `TrainConfig`'s fields, in order, each with its `--help` title."""
GROUP_LINE = re.compile(r"^    # --- (\w+) ---$")
FIELD_LINE = re.compile(r"^    (\w+): ")


@dataclass
class TrainConfig:
    # --- layout ---
    tp: int = 1
    """Tensor-parallel size (ranks that split each layer)."""
    cp: int = 1
    """Context-parallel size: ranks that split every sequence (a ring of K/V blocks where kv heads equal query heads, an all-gather of K/V for grouped-query heads: chosen per model, or as --cp-comm-type says; --seq-len must be divisible by 2 x cp, and by cp x tp too with --sequence-parallel). The mesh is tp x cp x pp x dp."""
    cp_comm_type: str = "auto"
    """With --cp > 1: how context-parallel attention communicates (Megatron-core's names): auto (each model's choice: p2p for multi-head attention, all_gather for grouped-query heads), p2p (a ring of K/V blocks, overlapped with the attention; scales past the head count), all_gather (one all-gather of K/V per layer) or a2a (DeepSpeed-Ulysses: all-to-alls turn a cp rank's tokens of every head into every token of a cp-th of the heads and back, 4 x a cp-th of the activations per layer; needs a tp rank's query heads divisible by cp, and replicates kv heads fewer than cp)."""
    pp: int = 1
    """Pipeline-parallel size (stages)."""
    decoder_first_pipeline_num_layers: int | None = None
    """Transformer blocks of the first pipeline stage, the one that also holds the embedding (Megatron-LM's flag): the other stages split the rest evenly (where it does not divide, the first of them one block more each; Megatron-LM refuses that). Under a schedule with several model chunks per rank (--schedule interleaved, zb-v, dualpipev) it is the blocks of the model's first chunk (on rank 0), and the other pp x V - 1 chunks split the rest (torchtitan's rule, chunk by chunk; Megatron-LM's interleaved schedule gives each of its first rank's chunks N / V instead). Lightens the stage a large vocabulary's embedding weighs on (docs/guides/schedules.md "Uneven stages": megapar-plan takes the flag and counts each stage with it). Needs --pp > 1 and at least one block left for every stage or chunk; the numbers and checkpoints do not depend on it (a checkpoint resumes with any split). Default: the even split."""
    decoder_last_pipeline_num_layers: int | None = None
    """Transformer blocks of the last pipeline stage, the one that also holds the final norm, the LM head and the loss (Megatron-LM's flag), the rest split evenly over the other stages; under several model chunks per rank, the blocks of the model's last chunk (on rank pp - 1; in the V of zb-v and dualpipev on rank 0). As --decoder-first-pipeline-num-layers, which it composes with."""
    account_for_embedding_in_pipeline_split: bool = False
    """Count the embedding as one more transformer block when the blocks are cut evenly into stages (or pp x V model chunks): the first stage (chunk) holds it in place of a block (Megatron-LM's flag; the counts need not divide evenly: the first slices take one more each). Not with --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers; needs --pp > 1."""
    account_for_loss_in_pipeline_split: bool = False
    """Count the LM head and the loss as one more transformer block when the blocks are cut evenly into stages (or pp x V model chunks): the last stage (chunk) holds them in place of a block (Megatron-LM's flag). As --account-for-embedding-in-pipeline-split, which it composes with."""
    dp: int | None = None
    """Data-parallel size; default world size / (tp * cp * pp) (1 when megapar-train starts the workers)."""
    ep: int = 1
    """Expert-parallel size: data- and context-parallel ranks that split each MoE layer's experts and exchange tokens by all-to-all (folded into dp x cp, as in Megatron and torchtitan: it must divide dp x cp and adds no ranks, e.g. --cp 2 --ep 2 at dp 1; expert weights are reduced over the dp x cp / ep ranks holding the same experts). Needs a model with experts (mixtral, qwen3_moe, deepseek_v3), as many as ep divides. Any --zero (ZeRO-3 shards the experts over the ranks holding them). Checkpoints (--save / --load, at any --zero) hold every expert whole with its optimizer state, so any ep (and any layout) resumes them."""
    expert_tensor_parallel_size: int = 1
    """Expert tensor parallelism (Megatron-core's --expert-tensor-parallel-size, torchtitan's ETP): 1 or --tp. At --tp, each routed expert's weights are split over the tp ranks as a dense MLP's are (gate / up column-parallel, down row-parallel; the router stays replicated) and the experts' output is all-reduced over tp (reduce-scattered after an all-gather of the routed tokens with --sequence-parallel): each rank holds and computes 1 / tp of every expert. At 1 (the default) every tp rank holds every expert whole and computes it on the same tokens (its own sequence slice with --sequence-parallel), with no tp collective in the MoE layer. Megatron's default is tp; megapar keeps 1 so existing runs keep their memory, communication and numbers, and because the split has not run on a GPU yet (its grouped matmuls, NCCL); a MoE run at --tp > 1 that does not give the flag says so in a start-up note, with the state a rank holds at 1 and at tp, where the split saves a rank at least 1 GiB. Composes with --ep (experts split over ep, each expert over tp), dp, every --zero, pp, --cp, --sequence-parallel, --recompute and --compile. Checkpoints hold every expert whole, so they resume at either value and in any layout. Needs a model with experts whose moe_intermediate_size --tp divides."""
    rank_order: str = "tp-pp-dp"
    """Rank order, fastest first: tp-pp-dp (dp outermost: gradient all-reduce crosses nodes) or tp-dp-pp (Megatron's: pp outermost, point-to-point crosses nodes)."""
    sequence_parallel: bool = False
    """Split LayerNorm, dropout and the residual stream along the sequence over the tp group (Megatron sequence parallelism; --seq-len must be divisible by --tp)."""
    sp_regather: bool = False
    """With --sequence-parallel: the column-parallel projections (q/k/v, gate/up, GPT-2's and BERT's fused ones) keep only this rank's sequence slice of their input for the backward and all-gather it again there, once per shared input (Megatron-LM's behaviour): two whole-sequence tensors per block and micro-batch become 1 / tp of them, for one more all-gather of s x b x h / tp per shared input in the backward. Ignored where the gathered input is kept anyway: zero-bubble deferred weight gradients, --fp8 linears, --recompute full, --compile'd blocks (docs/guides/parallelism.md)."""
    oversubscribe: bool = False
    """Start more local workers than 4 per CPU core (at least 8) when megapar-train starts them itself; refused otherwise."""
    # --- model ---
    model: str | None = None
    """Model recipe from models/ (e.g. gpt2-124m, bert-base, gpt2-tiny, llama-1b, llama-tiny, mixtral-tiny, qwen3-moe-tiny, deepseek-v3-tiny) or a JSON/YAML config file; default gpt2-tiny (a --load's or --from-hf's model where one is given)."""
    from_hf: str | None = None
    """Start from a local transformers checkpoint directory (GPT2LMHeadModel / BertForMaskedLM / LlamaForCausalLM / Qwen3ForCausalLM / Qwen2ForCausalLM / MistralForCausalLM / MixtralForCausalLM / Qwen3MoeForCausalLM / DeepseekV3ForCausalLM): the model is its config.json's (a --model describing another is refused). Its own tokenizer (tokenizer.json, vocab.json + merges.txt, or tokenizer.model), if it has one, is the default --tokenizer, and a --tokenizer or a prepared --data of another tokenizer is refused, as is a tokenizer.json (or vocab.json + merges.txt) that transformers' AutoTokenizer reads otherwise for this model type (e.g. GPT-2's files in a Qwen2 directory); without one, the default gpt2 tokenizes raw text (a note says so)."""
    precision: str = "fp32"
    """fp32, bf16 (autocast, fp32 master weights) or fp16 (dynamic loss scaling)."""
    loss_scale: float = 0.0
    """With --precision fp16: a static loss scale (Megatron-LM's --loss-scale, DeepSpeed's loss_scale > 0): every step scaled by it, a step whose gradients overflow skipped (--max-nonfinite-steps of them in a row stop the run), the scale never changed. 0: dynamic (--initial-loss-scale ... --hysteresis)."""
    initial_loss_scale: float = 65536.0
    """With --precision fp16: the loss scale at the start (DeepSpeed's 2 ** initial_scale_power 16; Megatron-LM's default is 2 ** 32); a power of 2 keeps the unscaling exact."""
    min_loss_scale: float = 1.0
    """With --precision fp16: the floor of the loss scale; an overflow there stops the run (--max-nonfinite-steps > 0)."""
    loss_scale_window: int = 1000
    """With --precision fp16: consecutive steps without overflow after which the loss scale doubles."""
    hysteresis: int = 1
    """With --precision fp16: overflows since the last growth of the loss scale (or the start) before one halves it; every overflowed step is skipped. 1 halves at every overflow (torch's GradScaler); DeepSpeed's and Megatron-LM's default is 2."""
    tf32: bool = False
    """On CUDA: let fp32 matrix products use TensorFloat-32 (10-bit mantissa, several times faster on Ampere and newer GPUs). Off, fp32 runs keep full fp32 products and match one process to 1e-5."""
    recompute: str = "none"
    """Activation recomputation: none, selective (attention core) or full (each block)."""
    compile: bool = False
    """torch.compile each transformer block's forward (torchtitan's per-block compile; hooks stay outside, so ZeRO's gathers and gradient buckets work as in eager mode). Composes with tp and sequence parallelism, cp, every pipeline schedule (zero-bubble ones included), ZeRO-1/2/3 and their offload, selective / full recompute, bf16 / fp16 and --fp8, for GPT-2, Llama and BERT (benchmarks/vs/compile_layouts.py checks each against eager) and the MoE models (Mixtral, Qwen3-MoE: their routed experts run eagerly); tp collectives, cp attention's exchanges, zero-bubble deferred linears and attention dropout run eagerly between the compiled pieces. Off by default everywhere: the first step pays the compile (tens of seconds on a CPU), on the CPU it measured no faster than eager, and no GPU run has measured it yet (docs/performance.md "Compiled blocks on the CPU"). The dry run rehearses the eager blocks."""
    fp8: str = "off"
    """Run the blocks' linear layers in FP8 with torchao's float8 training (pip install 'megapar[fp8]'): tensorwise (one dynamic scale per tensor, the faster) or rowwise (per-row scales, more accurate); off. Needs a GPU with FP8 (compute capability >= 8.9) or --fp8-emulate. Weights, gradients and checkpoints stay in the master dtype; small layers stay in high precision (--fp8-layers; docs/guides/fp8.md)."""
    fp8_emulate: bool = False
    """With --fp8: torchao's emulate mode: the same float8 casts and scales, the products in fp32 on any device (CPU tests, the dry run; slower than bf16)."""
    fp8_layers: str = "auto"
    """With --fp8: which block linears run in float8, by each layer's whole N x K (the same layers at every tp; a tp splitting one into shards that are not multiples of 16 is refused): auto (torchao's size rule; smaller layers are slower in FP8) or all (every one whose dims are multiples of 16)."""
    loss_chunk_tokens: int = 1024
    """Tokens per chunk of the fused LM head and cross-entropy: each chunk's logits are computed, reduced to its loss and dropped; at tp 1 the chunk's gradients are formed right away and held to the backward (the head's fp32 weight gradient kept from forward to backward), at tp > 1 the backward recomputes the logits (one more head matmul), so the whole [tokens x vocabulary] logits never exist (with Llama 3's 128,256-token vocabulary a 1,024-token chunk is 0.5 GB in fp32). The loss accumulates in fp32 and equals the unchunked one. 0: the whole micro-batch's logits at once."""
    loss_mean: str = "microbatch"
    """What the loss averages: microbatch (Megatron's default, megapar's except on prompt / response records: each micro-batch's mean over its labelled tokens, averaged over the micro-batches and dp ranks; with labels unevenly spread (-100 padding, SFT masks, BERT's MLM) the loss and gradients then depend on the micro-batch size, and a micro-batch with no labelled token counts as a loss of 0) or token (the sum over every labelled token of the global batch over their count, as one forward of the whole batch with reduction="mean" would give, the same at any micro-batch size and layout: Megatron's --calculate-per-token-loss, torchtitan's and transformers' Trainer's normalisation). The evaluation loss follows it. Default: token on prompt / response records (--sft-keys, or a dataset megapar-data --sft-keys wrote: TRL's and torchtune's SFT loss), microbatch otherwise. Mixture-of-experts balancing losses stay per micro-batch (docs/guides/training.md "What the loss averages")."""
    label_smoothing: float = 0.0
    """Label smoothing of the training loss, in [0, 1): torch's F.cross_entropy(label_smoothing=EPS) and transformers' Trainer's --label_smoothing_factor (the target is 1 - EPS on the label plus EPS / vocabulary on every token, the label's included; Megatron-LM's --label-smoothing spreads EPS over the other tokens only, so its EPS is megapar's EPS x (V - 1) / V), over the real vocabulary (tp's padding columns left out) and the labelled tokens, at any layout. The evaluation loss (--eval-interval, megapar-eval's perplexity) stays the plain cross-entropy. 0: off."""
    z_loss: float = 0.0
    """Coefficient of PaLM's output z-loss (OLMo's z_loss_multiplier / auxiliary_loss_multiplier / softmax_auxiliary_loss_scale, e.g. 1e-4): COEF x the mean over the labelled tokens of logsumexp(logits)^2, averaged as the loss is (--loss-mean), is added to the loss that is backpropagated and logged as its own term (z_loss; the logged loss stays the cross-entropy). The log-sum-exp is the cross-entropy's own (under tp: its all-reduces, none added). Training only, as --label-smoothing. 0: off."""
    moe_aux_loss_coef: float | None = None
    """Mixture of experts: coefficient of the switch-style load-balancing loss (transformers' router_aux_loss_coef: each MoE layer's loss counts 1 / MoE layers; 0: none). Default: the model config's."""
    moe_z_loss_coef: float | None = None
    """Mixture of experts: coefficient of the router z-loss (ST-MoE; 0: none). Default: the model config's (0)."""
    moe_capacity_factor: float | None = None
    """Mixture of experts: each expert keeps at most ceil(factor x tokens x k / experts) of a micro-batch's assignments on a rank, the rest are dropped (zero output) and counted in the log; 0: dropless. Default: the model config's (dropless)."""
    moe_bias_update_rate: float | None = None
    """Mixture of experts: DeepSeek-V3's auxiliary-loss-free balancing, the step by which each expert's routing bias moves toward a balanced load after every step (0: off). Default: the model config's (0)."""
    # --- data ---
    data: str | list[str] | None = None
    """Dataset prefix (PREFIX.bin/.idx from megapar-data, or a Megatron-LM MMIDIDX dataset) or raw text: a .txt / .jsonl / .json / .parquet file or a directory of them (tokenized into --data-cache); or a blend "W1 PREFIX1 W2 PREFIX2 ..." (Megatron's syntax). Default: the shipped Shakespeare sample."""
    tokenizer: str = "gpt2"
    """Tokenizer for raw text (and for a Megatron-LM dataset without megapar's .json, which needs it given): gpt2, sentencepiece, a transformers directory with tokenizer.json, a vocab.json+merges.txt dir or a .model file. Default: gpt2; with --load, the tokenizer the checkpoint's data was tokenized with; with --from-hf DIR, DIR's own."""
    data_cache: str = "~/.cache/megapar"
    """Where raw text is tokenized to (keyed by content hash and the settings below)."""
    jsonl_key: str = "text"
    """For raw .jsonl / .json / .parquet data: the key (column) holding each document's text."""
    sft_keys: str | None = None
    """Supervised fine-tuning on JSON Lines records: PROMPT,RESPONSE names the two fields (e.g. prompt,response; TRL's prompt,completion). Each record is one sample: the prompt's tokens, the response's and the end-of-text token, cut to --seq-len + 1 (longer records are truncated, counted in the log), right-padded, with the loss on the response (and its end) only. A dataset megapar-data --sft-keys wrote needs no flag. The loss is the mean over the global batch's response tokens, TRL's / torchtune's (--loss-mean's default here; docs/guides/training.md "Fine-tuning on prompt / response pairs")."""
    allow_invalid_utf8: bool = False
    """For raw text: replace invalid UTF-8 with U+FFFD even above 0.1 % of a file's bytes (else an error; fewer are replaced with a warning)."""
    val_fraction: float = 0.05
    """Share of documents held out for validation, drawn with --seed (another seed holds out other documents)."""
    seq_len: int = 128
    """Sequence length in tokens."""
    attention_mask_type: str = "causal"
    """What a token of a packed sequence attends to: causal (every earlier token of the sequence, across the documents packed into it) or block_causal (only the earlier tokens of its own document, the end-of-document token ending it: torchtitan's attn_mask_type, Megatron-LM's --reset-attention-mask, Llama 3's document masking). An explicit mask per micro-batch, made on the device from the input ids and shared by the layers (and ANDed with a sliding window); GPT-2 and the Llama family, in every layout (under --cp every --cp-comm-type: the all-to-all takes the whole sequence's mask, the ring and the all-gather mask each block of keys by its tokens' documents)."""
    reset_position_ids: bool = False
    """Positions restart at 0 after each end-of-document token (Megatron-LM's --reset-position-ids): Llama's rotary angles and GPT-2's learned positions are each token's position in its document."""
    eod_mask_loss: bool = False
    """No loss on the positions whose input is the end-of-document token (Megatron-LM's --eod-mask-loss): the prediction of the next document's first token across the boundary. Their labels become -100 before the loss and its token counts."""
    eod_id: int | None = None
    """The end-of-document token's id that --attention-mask-type block_causal, --reset-position-ids and --eod-mask-loss read. Default: the data's tokenizer's."""
    micro_batch_size: int = 4
    """Sequences per micro-batch. Not given, it is the largest size up to 4 that divides a given --global-batch-size over dp, and that gives the pipeline schedule micro-batches it takes, or shrinks with the global batch to what a small dataset holds (with a note)."""
    global_batch_size: int = 16
    """Sequences per optimizer step (micro-batch size x micro-batches x dp). Not given, it is the multiple of micro-batch size x dp nearest 16 (one at least; with a note), shrinks to what a small dataset holds (with a note), or with --load is the checkpoint's; another than the checkpoint's continues its data order (the epoch's next samples, this many a step)."""
    allow_data_change: bool = False
    """With --load: continue on --data whose content differs from what the checkpoint trained on (its recorded fingerprint or its number of samples), on purpose: the same number of samples continues the data order, another number starts it anew; without it such a resume is refused."""
    # --- schedule ---
    schedule: str = "1f1b"
    """Pipeline schedule: gpipe, 1f1b, interleaved (needs --virtual-stages >= 2), zb-h1 (zero bubble), zb-v (zero bubble, two chunks per rank in a V) or dualpipev (DeepSeek's DualPipe in the V; m >= 2 x pp)."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank for --schedule interleaved (Megatron's round-robin: rank r holds chunks r, r+pp, ...). zb-v and dualpipev always place two (rank r holds virtual stages r and 2 pp - 1 - r) whatever it says: they accept 1 (the default) or 2 and refuse any other value."""
    p2p_dtype: str = "auto"
    """Dtype of pipeline messages on the wire: auto (the --precision compute dtype, Megatron's pipeline_dtype: bf16 / fp16 under mixed precision, fp32 otherwise), fp32, bf16 or fp16. Received activations and gradients are cast back, so only the bytes change."""
    # --- zero ---
    zero: int = 0
    """1 shards the optimizer state over data-parallel ranks (ZeRO-1); 2 also the reduced gradients (ZeRO-2: each rank keeps only its slice; every micro-batch's gradients are reduce-scattered bucket by bucket as its backward finishes them and added into the slice, as DeepSpeed does); 3 also the parameters (ZeRO-3, FSDP-style: each transformer block, and the rest of the stage, all-gathered before its forward and again before its backward (the head's unit once: kept from its forward to its backward, as FSDP2 keeps its root), then freed; gradients reduce-scattered; 16/dp bytes per parameter between steps)."""
    offload_optimizer: bool = False
    """Keep the fp32 master copy of the stepped parameters (or ZeRO slices) and the optimizer's moments in host memory (pinned on CUDA) and step there: each step copies the reduced, clipped gradients to the host and the updated parameters back (DeepSpeed's offload_optimizer). AdamW and SGD. On the CPU the host is the device: nothing moves."""
    offload_params: bool = False
    """With --zero 3 and --offload-optimizer: keep the parameter shards (the fp32 weights the optimizer steps) in host memory (pinned on CUDA) and copy each unit's shard to the device just for its gather (DeepSpeed's offload_param; under bf16 / fp16 the blocks' linear weights are rounded to 16 bits on the device and gathered in 16 bits). On the CPU the host is the device: nothing moves."""
    zero3_persistence_threshold: int = 0
    """With --zero 3: parameters with fewer elements than this (biases, norms) are not gathered per use: they form one unit gathered at the stage's first forward of a step and kept until its end (DeepSpeed's stage3_param_persistence_threshold; 0: none). Still sharded between steps."""
    zero3_keep_params: bool = False
    """With --zero 3: keep a unit's gathered parameters until the end of the step instead of freeing them after each forward and backward (torchtitan's reshard_after_forward=False): one all-gather per unit and step instead of two per micro-batch, at the price of the stage's whole parameters during the step."""
    zero3_reduce: str = "step"
    """With --zero 3: when each unit's gradient is reduce-scattered: step (once, after the last micro-batch's backward; each unit's full gradient is kept over the step's micro-batches, as FSDP2 under pipelining) or micro-batch (in every micro-batch's backward, added into the rank's slice, as DeepSpeed's stage 3: m x the reduce-scatter bytes, and no unit's full gradient kept from one micro-batch to the next). The same with one micro-batch per step."""
    grad_reduce_dtype: str = "auto"
    """Dtype of the data-parallel gradient reduction: auto (Megatron's: fp32 under fp32 and bf16, fp16 under fp16), fp32, bf16 or fp16. Gradients are still accumulated and stepped in fp32."""
    grad_bucket_mb: float = 25.0
    """Data-parallel gradient bucket size in MB (gradients live in one buffer cut into buckets; each bucket is all-reduced in place as soon as its gradients are final)."""
    grad_compression: str = "none"
    """Data-parallel gradient reduction: none, fp16 / bf16 (cast, fp16 scaled) or powersgd."""
    powersgd_rank: int = 4
    """Rank of PowerSGD's low-rank factors (--grad-compression powersgd)."""
    # --- optimizer ---
    lr: float = 1e-3
    """Peak learning rate."""
    min_lr: float = 1e-4
    """Learning rate at the end of the decay. Not given, it is at most --lr x 0.1 (the defaults' ratio; with a note)."""
    lr_decay: str = "cosine"
    """Decay after warmup: cosine, linear, constant, or wsd (warmup-stable-decay: --lr until a final decay to --min-lr over the last --lr-wsd-decay-steps, shaped by --lr-wsd-decay-style; Megatron-LM's --lr-decay-style WSD)."""
    lr_decay_steps: int = 0
    """Step at which the decay reaches --min-lr, which holds after it (Megatron-LM's --lr-decay-iters; 0: --max-steps). The schedule counts steps from 0, as transformers' and Megatron-LM's do: the log's step N trains at schedule step N - 1, so --min-lr is first reached at the log's step N + 1 (docs/guides/training.md)."""
    lr_wsd_decay_steps: int = 0
    """With --lr-decay wsd: steps of the final decay, which ends at --max-steps, or --lr-decay-steps (0: --lr-wsd-decay-fraction of those)."""
    lr_wsd_decay_fraction: float = 0.2
    """With --lr-decay wsd and no --lr-wsd-decay-steps: the final decay's share of --max-steps, or of --lr-decay-steps (torchtitan's decay_ratio)."""
    lr_wsd_decay_style: str = "linear"
    """With --lr-decay wsd: the final decay's shape: linear, cosine, sqrt (1 - sqrt of the progress; Megatron-LM's minus_sqrt, transformers' 1-sqrt) or exponential (Megatron-LM's 2 x 0.5^progress - 1)."""
    warmup_steps: int = 20
    """Linear warmup steps. Not given, at most 10 % of --lr-decay-steps or --max-steps (with a note)."""
    weight_decay: float = 0.1
    """Weight decay of matrices and embeddings, not of biases and norms: decoupled (each step takes lr x decay x the weight off it) for AdamW and Muon, added to LAMB's update before its trust ratio, and an L2 term added to the gradient for SGD and LARS (as torch.optim.SGD's weight_decay and the LARS paper apply it)."""
    optimizer: str = "adamw"
    """adamw, lamb or lars (layer-wise trust ratio, for large batches; LARS's eta is 1e-3, so it wants an --lr near 1), sgd (with momentum), or muon (torch.optim.Muon's orthogonalised momentum for the transformer blocks' 2-D weights, AdamW with the --adam-* settings for embeddings, head, norms, biases and routed experts; one --lr and --weight-decay for both; any --zero, not --offload-optimizer)."""
    muon_momentum: float = 0.95
    """Muon's momentum (Nesterov), --optimizer muon."""
    muon_adjust_lr: str = "match_rms_adamw"
    """Muon's per-matrix learning-rate factor: match_rms_adamw (Moonlight's 0.2 x sqrt(max(rows, cols)): the update's RMS is AdamW's, so an AdamW --lr and --weight-decay carry over) or original (Keller Jordan's sqrt(max(1, rows / cols)), which wants a larger --lr, e.g. 0.02)."""
    muon_distributed: bool = False
    """--optimizer muon with --zero 1, 2 or 3: each whole matrix is orthogonalised by one rank of its data-parallel x tensor-parallel group (balanced by Newton-Schulz cost, on the dp rank whose ZeRO slices hold the most of it where the balance allows) and the results sent back, as Megatron's distributed optimizer and torchtitan's DistMuon do, instead of every rank orthogonalising every matrix: 1/(dp x tp) of the Newton-Schulz compute, the same weights bit for bit; its traffic is two all-to-alls of the Muon matrices' updates over dp and, for a tp-split matrix, a gather to and a scatter from its owning tp rank (docs/guides/training.md#muon). Not taken from a --load checkpoint (like --zero)."""
    adam_eps: float = 1e-8
    """Epsilon of AdamW / LAMB (added to the root of the second moment)."""
    adam_beta1: float = 0.9
    """AdamW / LAMB beta1: decay of the first-moment (gradient) average."""
    adam_beta2: float = 0.95
    """AdamW / LAMB beta2: decay of the second-moment average (Megatron's GPT setting; torch's
    default is 0.999)."""
    lr_scale_with_batch: int = 0
    """Linear LR scaling: the LR (and min LR) become --lr x global batch / this (0: off)."""
    clip_grad: float = 1.0
    """Clip the global gradient norm to this (0 disables)."""
    max_steps: int = 300
    """Optimizer steps to train for."""
    seed: int = 1234
    """Seed for weights, data order, dropout and which documents --val-fraction holds out (results do not depend on the layout)."""
    # --- checkpoint ---
    save: str | None = None
    """Checkpoint directory to save into."""
    save_interval: int = 0
    """Save every N steps (0: only at the end)."""
    keep_latest_k: int = 0
    """Keep only the newest K checkpoints in --save (torchtitan's checkpoint.keep_latest_k): once a step is published, rank 0 deletes the older step_* directories beyond K (never the one `latest` names; --record-step's records stay). 0 (the default) keeps every step."""
    async_save: bool = False
    """Save without stopping training: the state is copied to host memory (pinned on GPUs; as much as the rank's shard file) and a background thread writes it; the checkpoint is published (and `latest` moved) once every rank's files are complete. At most one write in flight; the final save (and one on a stop) is waited for before exit."""
    load: str | None = None
    """Checkpoint to resume from (a directory written by --save, or one of its step dirs). A directory that does not exist yet or holds no checkpoint starts a fresh run of --model / --from-hf (logged; without either it is an error), so a requeued job can pass the same --load as its --save. A file, or a step_* directory that is not there, is an error."""
    load_strict: bool = False
    """Fail instead of starting fresh when --load holds no checkpoint."""
    overwrite_newer: bool = False
    """Let this run replace the steps in --save newer than the one it starts from (--load's, or 0 when it starts fresh): they are removed when it starts (named in a note); without it such a --save is refused, since its steps and `latest` would be replaced or left mixed with this run's."""
    # --- logging ---
    eval_interval: int = 100
    """Evaluate on the validation split every N steps (0 disables)."""
    eval_steps: int = 4
    """Validation batches per evaluation."""
    log_interval: int = 10
    """Print a log line every N steps."""
    log_json: str | None = None
    """Write one JSON object per step (step, loss, lr, grad_norm, tokens_per_s, ...) to this file."""
    tensorboard: str | None = None
    """Write TensorBoard scalars to this directory."""
    wandb_project: str | None = None
    """Log to Weights & Biases (offline mode when there is no network)."""
    peak_tflops: float = 1.0
    """Peak TFLOP/s of one device, for MFU. Not given: the GPU's dense datasheet figure for --precision (and --tf32) where megapar knows it (A100, H100, H200; e.g. 989 for H100 bf16), else 1.0 (a rough CPU figure)."""
    profile_steps: str | None = None
    """Record a torch.profiler Chrome trace of steps A:B (e.g. 5:7) on every rank."""
    profile_dir: str = "profile"
    """Where --profile-steps writes trace_rank<R>.json."""
    progress: bool | None = None
    """Show a progress bar on rank 0 (and while raw --data is tokenized). Not given: only when stderr is a terminal, so a log file (a redirect, a pipe, a batch job) gets the log lines alone."""
    # --- faults ---
    timeout_s: float = 300.0
    """Timeout of every collective / point-to-point wait, in seconds (on GPUs: of the wait for all ranks to join; NCCL's own is --nccl-timeout-s). Not given: $MEGAPAR_TIMEOUT_S where it is set."""
    nccl_timeout_s: float = 1800.0
    """On GPUs: timeout of the NCCL process groups, in seconds (NCCL's watchdog aborts a collective that has not finished by then). It also runs while ranks wait in a collective for a checkpoint save or a resharding load, so it is longer than --timeout-s. Not given: $MEGAPAR_NCCL_TIMEOUT_S where it is set."""
    max_nonfinite_steps: int = 5
    """Stop (rc 1, nothing saved) after this many consecutive steps with a non-finite loss or gradient norm (fp16: a non-finite loss; an overflow with a finite loss is skipped and not counted, but one at the loss scale's floor, --min-loss-scale, stops the run). 0 never stops."""
    exit_signals: str = "SIGTERM,SIGUSR1"
    """Signals that make every rank finish its step, save (with --save) and exit 0, by name or number (15,10); "" for none (a SIGTERM not named aborts the run without a save, exit 143). A first SIGINT does the same, a second (1 s or more later) aborts."""
    exit_duration_mins: float = 0.0
    """Finish the step, save and exit 0 once the run has trained this many minutes (0: no limit)."""
    exit_interval: int = 0
    """Finish, save and exit 0 at the first step that is a multiple of N (0: never)."""
    straggler_factor: float = 1.5
    """Name a rank whose compute time in a step (its own work in its device's time, without the time it waits on other ranks: on CUDA its forward / backward kernels less its tp / cp collectives, on the CPU its computing thread's CPU time; the least of the log interval's steps) is more than this many times the median of the other ranks of its pipeline stage (a rank alone in its stage: its own earlier intervals) and 50 ms above it, in two log intervals in a row holding 4 steps or more: in the log line and --log-json. 0 turns it off (no timing, no gather)."""
    # --- debug ---
    record_step: int = 0
    """Record step N's per-module values (each rank's output norms per micro-batch, weight-gradient norms) in SAVE/records/step_NNNNNNNN.json + .safetensors (N as 8 digits, as step directories), for --replay to compare with (needs --save; 0: none)."""
    replay: int = 0
    """With --load: run the steps after the checkpoint up to step N, print N's per-module output and weight-gradient norms, compare them with the run's record (--record-step) and name the first module and rank whose values differ; then exit without saving. Runs in any layout (--tp, --pp, --dp, --cp, --sequence-parallel; one process is enough), whatever the recorded run's was. 0: off."""
    replay_against: str | None = None
    """The record --replay compares with (default: records/step_N.json of the --load checkpoint's --save directory)."""
    inject_corrupt: str | None = None
    """A testing tool: corrupt one value of one module's output on one rank at one step, e.g. step=3,module=transformer.h.3.attn,tp=1 (also cp=, dp=, pp=, mb= the micro-batch, index= the flat index into that rank's output, value=nan|inf|-inf|NUMBER; default nan). The module is named as in the Hugging Face export. The environment's MEGAPAR_INJECT_CORRUPT is used when the flag is not given."""
    inject_slow: str | None = None
    """Testing tool: slow one global rank's forward computations by T ms per step from step S on, as a slow device would (CUDA: a spinning kernel; CPU: busy CPU time): rank=R,ms=T[,from_step=S] (e.g. rank=1,ms=300)."""
    dry_run: bool = False
    """Rehearse the job on this CPU instead of training: the real start-up and one step's bookkeeping of each sampled rank of a --world-size job on a fake process group and fake tensors (no communication, no memory); prints each rank's weights, gradients, optimizer state, modelled activations, communication per step and checkpoint files, or fails with the error the job would give."""
    world_size: int | None = None
    """With --dry-run: ranks of the job (dp = world size / (tp x cp x pp)); default tp x cp x pp x dp. At most 1,048,576 (one rehearsed rank of such a job takes 30 s and 1 GB: it builds all of the job's groups)."""
    gpus_per_node: int = 8
    """With --dry-run: ranks per node (which groups cross nodes)."""
    gpu_memory_gb: float = 80.0
    """With --dry-run: each GPU's memory in GiB, as megapar-plan's --gpu-memory-gb (default 80: an H100's or an 80 GB A100's): each rehearsed rank's modelled peak on a GPU is held to it, and the ranks that would not fit are named."""
    dry_run_ranks: str = "sample"
    """With --dry-run: the ranks to rehearse: sample (every stage, every tp rank, and the dp ranks whose state differs: the first, the last and, with --zero 1 or more, one in the middle; with --cp one at the last cp rank; the dry run names them and why), all, or a list of ranks and ranges like 0,7,1000-1023. A choice estimated to take over an hour (0.5 s per rank, plus 30 us per rank of the job) is refused: rehearse it in parts."""
    json: bool = False
    """With --dry-run: print one JSON object per rehearsed rank (figures in bytes) instead of text."""
    debug: bool = False
    """Print a failing worker's full traceback on the terminal (it is always in the per-rank log)."""

    # Not a field (no annotation, so no flag): the settings the user gave, set by `parse_args`
    # and `settings_from_checkpoint`; None for a config built in code (`validate.explicit`).
    explicit = None  # type: frozenset[str] | None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def pipeline_split(self) -> PipelineSplit:
        """How the blocks are cut into pipeline stages or chunks (`PipelineSplit`) as
        --decoder-first/last-pipeline-num-layers and --account-for-embedding/loss-in-pipeline-
        split say; the even cut without them."""
        return PipelineSplit(
            self.decoder_first_pipeline_num_layers,
            self.decoder_last_pipeline_num_layers,
            self.account_for_embedding_in_pipeline_split,
            self.account_for_loss_in_pipeline_split,
        )

    @property
    def zero3_float8(self) -> str | None:
        """ZeRO-3 gathers the --fp8 weights as float8 bytes (tensorwise, not --compile'd
        blocks, whose traced casts read the fp32 weight, nor --offload-params, whose shards are
        on the host; `data_parallel.zero3_float8`): the --fp8-layers it converts; else None."""
        on = self.zero == 3 and self.fp8 == "tensorwise"
        return self.fp8_layers if on and not (self.compile or self.offload_params) else None

    @property
    def zero3_half(self) -> torch.dtype | None:
        """ZeRO-3 gathers the blocks' (non-float8) linear weights in the autocast dtype under
        bf16 / fp16 (also in --compile'd blocks, whose traced linears read the copies, and
        under --offload-params, whose host shards are copied up and rounded on the device;
        `data_parallel.zero3_half`): that dtype; else None (fp32 gathers)."""
        on = self.zero == 3 and self.precision != "fp32"
        return PRECISIONS[self.precision] if on else None

    @property
    def zero12_half(self) -> torch.dtype | None:
        """ZeRO-1 / 2 all-gather the blocks' (non-float8) linear weights in the autocast dtype
        after each step under bf16 / fp16, each rank keeping its own slice in fp32 (`optim.zero`;
        --offload-optimizer too, whose masters are this rank's slices): that dtype; else None
        (fp32 gathers)."""
        on = self.zero in (1, 2) and self.precision != "fp32"
        return PRECISIONS[self.precision] if on else None


def field_docs() -> dict[str, str]:
    """Each field's docstring (the string literal right after it in the class body)."""
    return dict(_field_docs())


@functools.cache
def _field_docs() -> dict[str, str]:
    """`field_docs`, read from the source once a process (every parser is built from it: 40 ms
    of parsing the class's source each time, most of what a test of a command line spent)."""
    tree = ast.parse(inspect.getsource(TrainConfig))
    cls = tree.body[0]
    assert isinstance(cls, ast.ClassDef)
    body = cls.body
    docs: dict[str, str] = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
        ):
            assert isinstance(node.target, ast.Name)  # a class body annotates names
            docs[node.target.id] = str(nxt.value.value)
    return docs


def field_groups() -> dict[str, str]:
    """Each field's group (a key of `GROUPS`): the ``# --- group ---`` line above it in the
    class body."""
    return dict(_field_groups())


@functools.cache
def _field_groups() -> dict[str, str]:
    """`field_groups`, read from the source once a process (as `_field_docs`)."""
    names = {f.name for f in fields(TrainConfig)}
    group: str | None = None
    out: dict[str, str] = {}
    for line in inspect.getsource(TrainConfig).splitlines():
        if opened := GROUP_LINE.match(line):
            group = opened.group(1)
        elif (field := FIELD_LINE.match(line)) and field.group(1) in names:
            assert group is not None  # the class body opens with a group line
            out[field.group(1)] = group
    return out


def choice_problem(name: str, value: Any) -> str:
    """ "--name 'value' is invalid: choose one of ..." when setting `name` has a fixed set of
    values (`flag_choices`) and `value` is not among them, else ""; a schedule another tool
    names is named as megapar's too (`schedule_named_elsewhere`)."""
    allowed = flag_choices().get(name)
    if allowed is None or value in allowed:
        return ""
    elsewhere = schedule_named_elsewhere(value) if name == "schedule" else ""
    return (
        f"--{name.replace('_', '-')} {value!r} is invalid: choose one of "
        f"{', '.join(map(str, allowed))}" + (f"; {elsewhere}" if elsewhere else "")
    )


def flag_choices() -> dict[str, list]:
    """Allowed values, taken from the modules that implement them."""

    return {
        "rank_order": list(RANK_ORDERS),
        "cp_comm_type": list(CP_COMM_TYPES),
        "schedule": list(SCHEDULES),
        "recompute": list(RECOMPUTE_MODES),
        "precision": list(PRECISIONS),
        "fp8": list(FP8_RECIPES),
        "fp8_layers": list(FP8_LAYERS),
        "p2p_dtype": COMM_DTYPES,
        "grad_reduce_dtype": COMM_DTYPES,
        "zero": [0, 1, 2, 3],
        "lr_decay": list(DECAY_STYLES),
        "lr_wsd_decay_style": list(WSD_STYLES),
        "optimizer": list(OPTIMIZERS),
        "muon_adjust_lr": list(ADJUST_LR),
        "grad_compression": list(GRAD_COMPRESSIONS),
        "zero3_reduce": list(ZERO3_REDUCES),
        "loss_mean": list(LOSS_MEANS),
        "attention_mask_type": list(MASK_TYPES),
    }


MULTI_VALUE = {"data"}  # flags that take several values (a blend: --data 0.7 A 0.3 B)


def _flag_kinds() -> dict[str, Any]:
    """megapar-train's flags and what each takes: "bool" (a switch: no value), int, float or
    str."""
    return {"--" + f.name.replace("_", "-"): _type_of(f) for f in fields(TrainConfig)}


def _type_of(f) -> Any:
    if f.name == "gpu_memory_gb":  # 80, or 80GB (its unit's name) as the user may write it
        return gib_amount
    text = str(f.type)
    if "bool" in text:
        return "bool"
    if "int" in text:
        return int
    if "float" in text:
        return float
    return str


def _escaped(docs: dict[str, str]) -> dict[str, str]:
    """Docstrings as argparse help (a literal % is %% there)."""
    return {name: text.replace("%", "%%") for name, text in docs.items()}


def _loss_scale_named_elsewhere(value: str) -> str:
    """For a --loss-scale word other tools take (apex's and fairseq's `dynamic`), megapar's way."""
    if str(value).lower() == "dynamic":
        return (
            "leave --loss-scale out: megapar's fp16 loss scale is dynamic unless --loss-scale S "
            "sets a static one (--initial-loss-scale, --loss-scale-window, --hysteresis shape it)"
        )
    return ""


def _cp_comm_named_elsewhere(value: str) -> str:
    """Megatron-core's hierarchical --cp-comm-type (a2a+p2p, or a list per level) and
    torchtitan's rotate methods, as megapar's one-level choices."""
    if "+" in value or "," in value:
        return (
            "megapar's cp group is one level (no hierarchical a2a+p2p): give --cp-comm-type a2a "
            "(a tp rank's heads divisible by cp) or p2p (the ring)"
        )
    return {
        "allgather": "give --cp-comm-type all_gather",
        "alltoall": "give --cp-comm-type a2a",
    }.get(value, "")


PRECISION_NAMES = {
    "bfloat16": "bf16",
    "bf16-mixed": "bf16",
    "bf16-true": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "16": "fp16",
    "16-mixed": "fp16",
    "float32": "fp32",
    "float": "fp32",
    "32": "fp32",
    "32-true": "fp32",
}
"""torch's dtype names and PyTorch Lightning's precision strings, as --precision's values."""


def precision_named_elsewhere(value: str) -> str:
    """For a --precision value named as torch or Lightning name it, megapar's."""
    name = PRECISION_NAMES.get(str(value).lower())
    return f"give --precision {name}" if name else ""


def _train_precision_named_elsewhere(value: str) -> str:
    """megapar-train's: torch's and Lightning's names, and FP8 (its own flag)."""
    if str(value).lower() in ("fp8", "float8", "transformer-engine", "8-mixed"):
        return "FP8 linears are --fp8 tensorwise (or rowwise) beside --precision bf16"
    return precision_named_elsewhere(value)


def _field_of(flag: str) -> dataclasses.Field | None:
    """TrainConfig's field of megapar-train's `flag` (--compile, or its name, compile); None for
    no such flag."""
    name = flag.removeprefix("--").replace("-", "_")
    return next((f for f in fields(TrainConfig) if f.name == name), None)


def _is_switch(flag: str) -> bool:
    """Whether megapar-train's `flag` (--compile) is a switch."""
    f = _field_of(flag)
    return f is not None and _type_of(f) == "bool"


def _switch_answer_on_the_line(flag: str, text: str) -> str | None:
    """The answer to another tool's switch given a value on megapar-train's line
    (`--gradient_checkpointing=False`, `--decay_lr false`, `--bf16 0`), `switch_answer`'s;
    None where the value is no true / false (0 / 1 are numbers unless the setting is a
    switch, `answers_a_switch`: `--loss_scale 0`)."""
    key, value = flag.removeprefix("--"), other_switch_value(text)
    if nowhere := reports_nowhere(key, text, "leave the flag out"):
        return nowhere
    if value is None or (text in ("0", "1") and not answers_a_switch(key, _is_switch)):
        return None
    return switch_answer(key, value, _off_by_default, "leave the flag out")


OFF_UNLESS_GIVEN = ("save", "load", "log_json", "tensorboard", "wandb_project", "profile_steps")
"""The settings that do nothing unless given (a checkpoint, a log, a profile): what their --no-
spelling, which is no flag, is told to leave out."""


def build_parser(prog: str = "megapar-train") -> argparse.ArgumentParser:
    parser = OneLineParser(
        known_as=OTHER_TOOLS_FLAGS,
        switch_known_as=_switch_answer_on_the_line,
        switch_defaults={  # None: chosen by the run (--progress: at a terminal)
            "--" + f.name.replace("_", "-"): None if f.default is None else bool(f.default)
            for f in fields(TrainConfig)
            if _type_of(f) == "bool"
        },
        off_values={
            **OFF_VALUES,
            **dict.fromkeys(map(flag_of, OFF_UNLESS_GIVEN), ""),
        },
        value_known_as={
            "--schedule": schedule_named_elsewhere,
            "--lr-decay": decay_named_elsewhere,
            "--lr-wsd-decay-style": decay_named_elsewhere,
            "--optimizer": optimizer_named_elsewhere,
            "--loss-scale": _loss_scale_named_elsewhere,
            "--cp-comm-type": _cp_comm_named_elsewhere,
            "--precision": _train_precision_named_elsewhere,
        },
        afterword=megatron_defaults,
        prog=prog,
        description=(
            "Train a GPT-2, BERT, Llama, Qwen3, Qwen2, Mistral, Mixtral, Qwen3-MoE or DeepSeek-V3 "
            "with tensor, context, pipeline, data and expert parallelism."
        ),
    )
    parser.add_argument(
        "--config",
        help="JSON or YAML file whose keys are these flags' names (command-line flags override it)",
    )
    docs, choices, group_of = _escaped(field_docs()), flag_choices(), field_groups()
    groups = {name: parser.add_argument_group(title) for name, title in GROUPS.items()}
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        kind = _type_of(f)
        default = "" if f.default is None else f" (default: {shown_default(f.default)})"
        group = groups[group_of[f.name]]
        if kind == "bool":
            group.add_argument(
                flag,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=docs.get(f.name, "") + default,
            )
        else:
            nargs: dict[str, Any] = {"nargs": "+"} if f.name in MULTI_VALUE else {}
            group.add_argument(
                flag,
                type=kind,
                default=None,
                choices=choices.get(f.name),
                help=docs.get(f.name, "") + default,
                **nargs,
            )
    return parser


def _switch_as_choice(name: str, flag: str, value: bool, path: str) -> str:
    """A `--config` file's true / false for a flag taking a word (in a YAML file, also an
    unquoted off, no, on or yes): false is the flag's choice of nothing, off or none (fp8: off,
    recompute: off); anything else is refused with the fix (naming YAML's reading in a YAML
    file)."""
    choices = [str(c) for c in flag_choices().get(name, [])]
    offs = [c for c in ("off", "none", OFF_VALUES.get(flag)) if c is not None and c in choices]
    nothing = offs[0] if offs else None
    if value is False and nothing:  # (precision: false is fp32, as --no-precision is told)
        return nothing
    yaml = str(path).lower().endswith((".yaml", ".yml"))  # JSON's true / false is so written
    field = _field_of(name)  # save: false was told to quote it (a run saving to ./false)
    if value is False and field is not None and field.default is None:
        raise ConfigError(
            f"{path}: {flag} false: megapar-train's default is no {flag}; remove the key"
            + (
                " (YAML reads an unquoted no / off as false: quote a value so named)"
                if yaml
                else ""
            )
        )
    said = f"{path}: {flag} {str(value).lower()} is invalid" + (
        " (YAML reads an unquoted yes / no / on / off as true / false)" if yaml else ""
    )
    fix = (
        f"choose one of {', '.join(choices)}"
        if choices
        else "give its value in quotes"
        if yaml
        else "give its value"
    )
    raise ConfigError(f"{said}: {fix}, or remove the key")


def _config_value(f, value: Any, path: str) -> Any:
    """A `--config` value converted with its flag's type, as the command line would: "1e-3"
    is 0.001, "no" is False, 32.0 is 32; null, or a value the flag cannot take, is an error.
    (A number that is not whole, for a whole-number flag, is left for check_settings to name.)"""

    flag, kind = "--" + f.name.replace("_", "-"), _type_of(f)
    if value is None:
        raise ConfigError(f"{path}: {flag}: null is not a value; remove the key to use the default")
    if f.name in MULTI_VALUE and (value == "" or isinstance(value, str) and not value.strip()):
        raise ConfigError(
            f"{path}: {f.name}: {value!r} is an empty path: give a text file, a directory of "
            f"them or a prepared prefix, or remove the key (the shipped sample)"
        )
    if f.name in MULTI_VALUE and isinstance(value, list):
        if any(isinstance(v, str) and not v.strip() for v in value):
            raise ConfigError(
                f"{path}: {f.name}: {value!r} holds an empty path: give a text file, a "
                f"directory of them or a prepared prefix"
            )
        if not value:  # (the blend's parser failed on it with an IndexError)
            raise ConfigError(
                f"{path}: {f.name}: [] names no data: give a text file, a directory of them or a "
                f'prepared prefix (e.g. {f.name}: ["corpus.txt"]), or remove the key (the '
                f"shipped sample)"
            )
        return [str(v) for v in value]
    if kind == "bool":
        if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
            return bool(value)
        said = other_switch_value(value.strip()) if isinstance(value, str) else None
        if said is not None:  # the words another tool's switch takes too (y / n: tf32: n was
            return said  # "invalid", where bf16: n was read as false; a re-test)
        raise ConfigError(
            f"{path}: {flag} {value!r} is invalid: a switch is true or false (also yes / no, 1 / 0)"
        )
    if kind is str:
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{path}: {flag} {value!r} is invalid: expected one value")
        if isinstance(value, bool):  # YAML's unquoted off / no: fp8 'False' was refused, 'off'
            return _switch_as_choice(f.name, flag, value, path)  # offered
        return str(value)
    if value is False:  # zero: false, clip_grad: false: the value that is off (it was "False
        off = OFF_VALUES.get(flag)  # is invalid: expected a whole number"; a re-test)
        if off is not None:
            raise ConfigError(f"{path}: {f.name}: false: write {f.name}: {off} (off)")
        if f.default == 0 and not isinstance(f.default, bool):  # label_smoothing, zero
            raise ConfigError(
                f"{path}: {f.name}: false: its default is {f.default:g} (off); remove the key"
            )
    try:
        if isinstance(value, bool) or isinstance(value, (dict, list)):
            raise ValueError
        if kind is int and isinstance(value, float):
            return int(value) if value.is_integer() else value
        return kind(value.strip() if isinstance(value, str) else value)
    except argparse.ArgumentTypeError as exc:  # a flag's own type's reason (gib_amount)
        raise ConfigError(f"{path}: {flag} {exc}") from None
    except (ValueError, TypeError, OverflowError):
        what = "a whole number" if kind is int else "a number"
        raise ConfigError(f"{path}: {flag} {value!r} is invalid: expected {what}") from None


def refused_flag(flags: list[str]) -> str | None:
    """The first of the flags another tool's config was translated into (``--zero 4``,
    ``--micro-batch-size auto``) whose value megapar-train refuses, said as megapar-train says
    it ("--zero 4 is invalid: choose one of 0, 1, 2, 3"); None where it takes them all. A value
    given as words, not pasteable (``(8 x dp)``, ``1, 2 or 3``), is not read; a number
    followed by ``x`` (``0 x the --dp size``), a factor of the value, is."""
    tokens: list[str] = []
    for flag in flags:
        try:
            tokens += shlex.split(flag)
        except ValueError:  # words with an apostrophe
            tokens += flag.split()
    by_flag = {"--" + f.name.replace("_", "-"): f for f in fields(TrainConfig)}
    for i, token in enumerate(tokens):
        f = by_flag.get(token)
        if f is None or f.name in MULTI_VALUE or _type_of(f) == "bool" or i + 1 == len(tokens):
            continue
        value, after = tokens[i + 1], tokens[i + 2 : i + 3]
        if value.startswith(("--", "(")) or (
            after and not after[0].startswith("--") and after[0] != "x"
        ):
            continue
        try:
            converted = _config_value(f, value, "")
        except ConfigError as exc:
            return str(exc).removeprefix(": ")
        problem = choice_problem(f.name, converted)
        if problem:
            return problem
        cfg = TrainConfig()
        setattr(cfg, f.name, converted)
        try:
            check_ranges(cfg, defaults=False)  # megapar-train's defaults are not the file's
        except UsageError as exc:
            return str(exc)
    return None


def _off_by_default(flag: str) -> bool:
    """Whether megapar-train's `flag` is off unless given: a switch, or a default of none, off,
    0 or no value (--recompute, --zero, --load); not --lr-decay (cosine) nor an auto."""
    f = _field_of(flag)
    return f is not None and f.default in (False, None, 0, "none", "off")


def command_line_flags(args: argparse.Namespace) -> dict[str, str]:
    """megapar-train's flags given on the command line `args`, as its text by flag (a switch by
    both its spellings): what another tool's file translated beside them says of them."""
    given: dict[str, str] = {}
    for f in fields(TrainConfig):
        value = getattr(args, f.name, None)
        if value is None:
            continue
        text = flag_with_value(f.name, value)
        given[flag_of(f.name)] = text
        if isinstance(value, bool):
            given["--no-" + f.name.replace("_", "-")] = text
    return given


def _lr_note(lr: float | None, before: Any, key: str) -> list[str]:
    """The note of the command line's --lr over the file's `key` `before` (a number unlike it),
    as the line's other flags are noted (its --lr was not; a re-test); [] otherwise. A number
    written as YAML reads 1e-4, a string, is one (it was not noted; a re-test)."""
    if isinstance(before, str):
        try:
            before = float(before)
        except ValueError:
            return []
    if lr is None or isinstance(before, bool) or not isinstance(before, (int, float)):
        return []
    return (
        []
        if float(before) == lr
        else [f"the command line's --lr {lr:g} over the file's {key} {before:g}"]
    )


def read_run_config(
    path: str,
    dp: int | None = None,
    lr: float | None = None,
    command_line: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The settings of a `--config` file, keys checked against the flags' names and values
    converted with the flags' types (so a file says what the command line says); `dp`, the
    command line's --dp, makes another tool's per-GPU batch a global one, and `lr`, its --lr,
    a DeepSpeed cosine's floor (a ratio of the lr) a number. Another tool's file is refused
    with its settings as flags, each the command line gives as it gives it (`command_line`,
    `command_line_flags`)."""

    by_name = {f.name: f for f in fields(TrainConfig)}
    if str(path).lower().endswith(".toml"):
        raise ConfigError(toml_job_config(path, _flag_kinds(), refused_flag, command_line))
    if not Path(path).suffix and not Path(path).expanduser().exists():  # torchtitan's llama3_8b
        raise ConfigError(f"{path}: no such config file; {TORCHTITAN_MODULE}")
    loaded = load_config_file(path)
    if not loaded:  # an empty file trained the defaults without a word, as --config '' did
        raise ConfigError(
            f"{path} holds no settings: write megapar-train's settings in it (e.g. "
            f"max_steps: 100), or leave --config out"
        )
    data = {str(k).replace("-", "_"): v for k, v in loaded.items()}
    torchtitan = any(isinstance(v, dict) and k in TORCHTITAN_SECTIONS for k, v in loaded.items())
    if torchtitan and not is_deepspeed_config(data):  # a DeepSpeed config has optimizer too
        said = f"{path} is a torchtitan job config, which megapar-train does not read"
        raise ConfigError(torchtitan_job(loaded, said, _flag_kinds(), refused_flag, command_line))
    if is_trainer_arguments(data, set(by_name)):  # before DeepSpeed's: both have fp16 / bf16
        before, file_data = data.get("learning_rate"), data
        if lr is not None:  # the command line's --lr: its flags and a cosine's floor (they
            data = trainer_at_lr(data, lr)  # said the file's; a re-test)
        data, notes = at_the_line(data, command_line, TRAINER_KEYS, add=True)  # a warmup ratio
        notes = _lr_note(lr, before, "learning_rate") + notes
        said = trainer_arguments(data, path, refused_flag, command_line, file_data)  # its steps
        raise ConfigError(said + "".join(f"; {note}" for note in notes))
    if is_accelerate_config(data):
        raise ConfigError(accelerate_config(data, path, refused_flag, command_line))
    if is_deepspeed_config(data):
        file_batch = data  # its checks, and the GPUs it implies, of the file's batch
        data, replaced = at_the_line(data, command_line, DEEPSPEED_KEYS, add=False)  # its batch
        file_lr = get_in(data, ("optimizer", "params", "lr"))
        replaced = _lr_note(lr, file_lr, "optimizer.params.lr") + replaced
        try:
            flags, left, auto = deepspeed_equivalents(
                data, dp, lr, TrainConfig.lr, file_batch, command_line
            )
        except ConfigError as exc:  # a value where DeepSpeed takes a section
            raise ConfigError(f"{path}: {exc}") from None
        ours = [k for k in left if k in by_name]  # megapar-train's own settings beside them
        flags += [flag_with_value(k, data[k]) for k in ours]
        left = [k for k in left if k not in by_name]
        try:  # the file's own translation at the line's dp, whose values the notes name (not
            own = deepspeed_equivalents(file_batch, dp, None, TrainConfig.lr)[0]  # those from
        except ConfigError:  # the line's: a global batch of its micro-batch; re-tests)
            own = None
        own = None if own is None else own + [flag_with_value(k, data[k]) for k in ours]
        noted = frozenset({"--lr", *DEEPSPEED_KEYS})  # (at_the_line's)
        batch = (  # the file's global batch in its own words
            f"train_batch_size {file_batch['train_batch_size']}"
            if "train_batch_size" in file_batch
            else batch_words(file_batch, DEEPSPEED_BATCH, command_line)
        )
        flags, notes = command_line_wins(
            flags, command_line, own, noted, {"--global-batch-size": batch}
        )
        notes = replaced + notes
        what = f"{path} is a DeepSpeed config, which megapar-train does not read"
        if line := refused_value(what, flags, refused_flag, data):
            raise ConfigError(line)
        raise ConfigError(
            f"{what}: give its settings as megapar-train flags (or a --config file of them)"
            + (f": {' '.join(flags)}" if flags else "")
            + (f" (no equivalent: {', '.join(left)})" if left else "")
            + "".join(f"; {note}" for note in notes)
            + (
                f'; and for the keys the Hugging Face Trainer fills ("auto"): '
                f"{', '.join(auto)}, megapar's own values"
                if auto
                else ""
            )
        )
    unknown = []  # every unknown key at once, not one per run
    for key in sorted(set(data) - set(by_name)):
        close = difflib.get_close_matches(key, sorted(by_name), n=1)
        if not close:  # lr_warmup: the settings that share its longer words (warmup_steps)
            words = {w for w in key.lower().split("_") if len(w) >= 5}  # not rate, peak
            shared = {n: max(map(len, words & set(n.split("_"))), default=0) for n in by_name}
            best = max(shared.values(), default=0)  # the longest word shared
            close = sorted(n for n, k in shared.items() if k and k == best)
            close = close if len(close) <= 3 else []
        hint = (
            f"did you mean {or_list([repr(c) for c in close])}?"
            if close
            else "valid keys are the megapar-train flags"
        )
        other = other_tools_answer(key)
        switch = data[key] if isinstance(data[key], bool) else None
        if type(data[key]) in (int, str) and str(data[key]).strip() in ("0", "1"):
            if answers_a_switch(key, _is_switch):  # YAML's bf16: 0, JSON's "1"
                switch = str(data[key]).strip() == "1"
        elif isinstance(data[key], str):  # YAML's bf16: n (a string), JSON's "false"
            switch = other_switch_value(data[key].strip())
        answered = switch_answer(key, switch, _off_by_default) if switch is not None else None
        answered = reports_nowhere(key, data[key]) or answered
        if answered:  # bf16: false asks for no --precision bf16
            hint = answered
        elif not other and data[key] is False and len(close) == 1 and _is_switch(close[0]):
            hint = (  # torch_compile: false was told "did you mean 'compile'?" (which is on)
                f"did you mean {close[0]!r}? false is its default (off): remove the key"
                if _field_default(close[0]) is False
                else f"did you mean {close[0]!r}? write {close[0]}: false"  # progress: chosen
            )  # by the run where not given (it was told to remove the key, leaving it on)
        elif other:
            hint = f"did you mean {other}?" if other.startswith("--") else other
        unknown.append(f"unknown setting {key!r}; {hint}")
    if unknown:
        raise ConfigError(f"{path}: " + "; ".join(unknown))
    return {key: _config_value(by_name[key], value, path) for key, value in data.items()}


def parse_args(argv=None) -> TrainConfig:
    args = build_parser().parse_args(argv)
    if args.config is not None and not args.config.strip():  # an unset $CONFIG: the defaults
        raise ConfigError(
            f"--config {args.config!r} is an empty path: give a YAML or JSON file of "
            f"megapar-train's settings, or leave the flag out"
        )
    values: dict[str, Any] = (
        read_run_config(args.config, args.dp, args.lr, command_line_flags(args))
        if args.config
        else {}
    )
    from_file = set(values)
    for f in fields(TrainConfig):
        given = getattr(args, f.name)
        if isinstance(given, list) and len(given) == 1:
            given = given[0]
        if given is not None:
            values[f.name] = given
            from_file.discard(f.name)
    for name in flag_choices():  # the file named, as its other errors name it
        problem = choice_problem(name, values[name]) if name in from_file else ""
        if problem:
            raise ConfigError(f"{args.config}: {problem}")
    for name in sorted(from_file):  # out of range or empty, said with the file that gave it
        alone = TrainConfig()
        setattr(alone, name, values[name])
        try:
            check_ranges(alone)
            check_empty(alone)
        except UsageError as exc:
            said = str(exc).replace("or leave the flag out", "or remove the key")
            raise ConfigError(f"{args.config}: {said}") from None
    given = frozenset(values)  # what the user set; the rest may adapt (validate.py)
    for name, variable in TIMEOUT_ENV.items():  # their environment's default, where set
        if name not in values and variable in os.environ:
            values[name] = env_seconds(variable, _field_default(name))
    cfg = TrainConfig(**values)
    cfg.explicit = given
    return cfg


def _field_default(name: str):
    return next(f.default for f in fields(TrainConfig) if f.name == name)
