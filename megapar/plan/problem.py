"""What a plan is for: the model, the cluster and the batch (`Problem`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property

from megapar.models.config import ModelConfig
from megapar.pipeline.partition import EVEN, PipelineSplit
from megapar.plan import experts
from megapar.tensor_parallel.linear_cross_entropy import LOSS_CHUNK_TOKENS


@dataclass
class Problem:
    """The model, the cluster and the batch a plan is for."""

    config: ModelConfig
    """Model config (GPT2Config / BertConfig / LlamaConfig)."""
    gpus: int
    """Total GPUs (N)."""
    gpus_per_node: int = 8
    """GPUs per node: tp stays within a node."""
    gpu_memory_gb: float = 80.0
    """Memory per GPU in GiB (an "80 GB" A100 has 80 GiB)."""
    global_batch: int = 512
    """Sequences per optimizer step."""
    seq_len: int = 1024
    """Tokens per sequence."""
    precision: str = "bf16"
    """fp32 (4-byte activations) or bf16 / fp16 (2-byte)."""
    master_weights: str = "fp32"
    """fp32: megapar today (fp32 params + grads + Adam, 16 B/param); separate: 16-bit params +
    fp32 grads + fp32 master and moments (Megatron, 18 B/param)."""
    fused_attention: bool = True
    """Count what torch's fused attention kernels keep, a log-sum-exp per head and token, not
    the a s^2 scores: what megapar-train's `scaled_dot_product_attention` runs on GPUs (flash
    or memory-efficient, attention dropout included) and on CPUs without attention dropout.
    False: the scores, their softmax and dropout mask, as the unfused kernel keeps them (the
    paper's count; megapar-train on a CPU with attention dropout). Context parallelism keeps a
    log-sum-exp either way."""
    peak_tflops: float = 312.0
    """Peak dense TFLOP/s of one GPU in `precision` (A100: 312 bf16, 19.5 fp32)."""
    efficiency: float = 0.6
    """Share of peak the matmuls achieve."""
    intra_gbps: float = 2400.0
    """Intra-node bandwidth per GPU, Gbit/s (A100 NVLink: 2400)."""
    inter_gbps: float = 200.0
    """Inter-node bandwidth per GPU, Gbit/s (one 200 Gb/s HDR InfiniBand NIC per GPU)."""
    latency_us: float = 10.0
    """Latency of one message (a ring collective sends 2 (n-1) of them in sequence)."""
    grad_bucket_mb: float = 25.0
    """megapar-train's --grad-bucket-mb (ZeRO-1 pads each bucket to a multiple of dp)."""
    pcie_gbps: float = 200.0
    """Host-device bandwidth per GPU, Gbit/s (offload's copies; PCIe 4.0 x16: about 200)."""
    zero3_persistence_threshold: int = 0
    """megapar-train's --zero3-persistence-threshold for ZeRO-3 layouts (0: none persist)."""
    optimizer: str = "adamw"
    """megapar-train's --optimizer as the state counts it (`plan.state.state_bytes`): adamw and
    lamb keep two fp32 moments and a step count per parameter, sgd and lars one momentum buffer,
    muon one momentum buffer per element of the blocks' 2-D weights and Adam's two moments and
    step count for the rest."""
    loss_chunk_tokens: int = LOSS_CHUNK_TOKENS
    """megapar-train's --loss-chunk-tokens: the head and loss run this many tokens at a time,
    so one chunk's logits are the most held (0: the whole micro-batch's, kept for backward)."""
    moe_imbalance: float | None = None
    """Mixture of experts under ep: the busiest rank's routed rows over the mean, which scales
    its experts' activations (`plan.experts`); None: the model's capacity factor, or
    `experts.DEFAULT_IMBALANCE` when dropless."""
    sp_regather: bool = False
    """megapar-train's --sp-regather for the layouts with sequence parallelism: the
    column-parallel projections' inputs kept as this rank's sequence slices and all-gathered
    again in the backward (`plan.layouts.regathers` says where it applies)."""
    target: str = "gpu"
    """What the process figure is for (`plan.process`): gpu (the allocator's reserve and the
    CUDA context on top of the tensors) or cpu (the heap's room and the runtime; megapar-train
    on CPU ranks)."""
    fp8: str = "off"
    """megapar-train's --fp8: off, tensorwise or rowwise (`plan.fp8`: which block linears
    convert at a layout, their FLOPs, amax all-reduces and memory terms)."""
    fp8_layers: str = "auto"
    """megapar-train's --fp8-layers: auto (torchao's size rule on each layer's whole N x K) or
    all (every block linear whose dims are multiples of 16); a tp splitting a chosen one into
    shards that are not multiples of 16 is refused (`plan.fp8.fp8_refusal`)."""
    compile: bool = False
    """megapar-train's --compile (each block's forward traced by torch.compile): its traced
    float8 casts read the fp32 weight, so ZeRO-3 gathers the float8 linears' weights in fp32,
    not as float8 bytes (`fp8.float8_gathered`, `TrainConfig.zero3_float8`)."""
    fp8_speedup: float = 2.0
    """The float8 matmuls' peak over `peak_tflops` (H100 / H200 dense: 1979 float8 TFLOP/s
    against 989 bf16, so 2.0): the rate of the converted linears' products. The casts' memory
    traffic is not modelled, so the speed-up it gives is an upper bound."""

    attention_mask_type: str = "causal"
    """megapar-train's --attention-mask-type: block_causal makes an additive mask of the whole
    sequence per micro-batch and sliding window on each model chunk, kept by its attention for
    the backward (`memory.document_mask_bytes`, counted in the activations); under context
    parallelism by the ring or the all-gather a block per kernel call instead (a transient)."""
    pipeline_split: PipelineSplit = EVEN
    """megapar-train's --decoder-first-pipeline-num-layers, --decoder-last-pipeline-num-layers,
    --account-for-embedding-in-pipeline-split and --account-for-loss-in-pipeline-split: how each
    layout's blocks are cut into its stages or model chunks (`PipelineSplit`); a layout it
    cannot cut is rejected with the reason (`plan.layouts.check`)."""
    tokenizer: str | None = None
    """megapar-train's --tokenizer whose vocabulary `config` has (`cli.plan_args.take_vocabulary`),
    carried by the printed command; None: the model's own vocabulary, or --vocab-size's."""
    vocabulary_kept: bool = False
    """Whether the run keeps `config`'s vocabulary whatever its data's tokenizer (a config file's
    vocab_size: `cli.plan_args.vocabulary_kept`); else the data's tokenizer replaces it."""

    @cached_property
    def config_json(self) -> str:
        """The model config as canonical JSON (what `plan.state`'s cached functions take)."""
        return json.dumps(self.config.to_dict(), sort_keys=True)

    @cached_property
    def layer_kinds(self) -> tuple[int, ...]:
        """Per layer, 1 for a mixture-of-experts layer and 0 for a dense one
        (`experts.layer_kinds`, worked out once per plan)."""
        return experts.layer_kinds(self.config)

    @property
    def act_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2

    @property
    def sixteen_bit(self) -> bool:
        """Autocast runs the matmuls in 16 bits on fp32 weights (megapar-train's bf16 / fp16)."""
        return self.precision != "fp32" and self.master_weights == "fp32"

    @property
    def dropout(self) -> bool:
        c = self.config
        return any(
            getattr(c, k, 0) > 0 for k in ("resid_pdrop", "attn_pdrop", "hidden_dropout_prob")
        )


def attention_dropout(config) -> float:
    """The model's attention-probability dropout (GPT-2's attn_pdrop, BERT's
    attention_probs_dropout_prob, Llama's attention_dropout)."""
    for key in ("attn_pdrop", "attention_probs_dropout_prob", "attention_dropout"):
        if getattr(config, key, 0):
            return float(getattr(config, key))
    return 0.0


def runs_fused_attention(config, target: str) -> bool:
    """Whether megapar-train's attention runs a fused kernel (`Problem.fused_attention`) on
    `target`'s ranks: on GPUs always; on CPU ranks only without attention dropout (in training
    torch's CPU kernel then falls back to the unfused one, which keeps the scores)."""
    return target == "gpu" or not attention_dropout(config)
