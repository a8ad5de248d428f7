"""Memory one rank needs: weights, gradients, optimizer state and activations.

Activations follow Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models" (Section 4): one transformer layer keeps, per micro-batch of b sequences of
s tokens, hidden h, a heads, tensor-parallel size t,

    no recompute, no SP      s b h (10 + 24/t + 5 a s / (h t))    bytes (16-bit activations)
    no recompute, SP         s b h (34 + 5 a s / h) / t
    selective (attention)    s b h (10 + 24/t)  (SP: 34 s b h / t)
    full recompute           2 s b h            (SP: 2 s b h / t): only the layer input

`paper_layer_bytes` is exactly that. `layer_bytes` is the same count term by term, so it can
also describe what megapar's implementation keeps: element size 4 in fp32, no dropout masks
when dropout is 0, and a fused attention kernel (PyTorch's scaled_dot_product_attention keeps
q, k, v and a log-sum-exp per row, its output being the projection's input, instead of the
a s^2 softmax): with those knobs it reproduces the bytes counted on CPU
(benchmarks/plan/plan_validate.py, tests/test_plan.py).

Term by term (elements unless noted; "rep" = replicated over tp unless SP):
  rep: LN1 input, LN1 output (QKV input), LN2 input, LN2 output (FC1 input)  4 s b h
       dropout masks after attention and MLP (1 byte each)                  2 s b h bytes
  /t:  Q, K, V 3 s b h; attention-output-projection input s b h; GELU input 4 s b h;
       FC2 input 4 s b h                                                    12 s b h
  /t:  attention scores: softmax output a s^2 b, its dropout mask (bytes) and output a s^2 b

That is a GPT-2 block (and BERT's: its layer input stands for LN1's input). `block_terms` gives
the counts of megapar's blocks, measured term by term on the models (`tests/test_plan.py`):
GPT-2 and BERT as above with an FFN of any width f (2 f s b / t for the MLP); Llama's RMSNorm
keeps its input, the normalised input and the output (3 s b h per norm, one fp32 1/rms per
token), its SwiGLU MLP keeps gate, act(gate), up and their product (4 f s b / t), and q, k, v
(k and v repeated to the local query heads), the attention output: 4 s b h / t. Under SP,
megapar keeps the gathered (whole-sequence) inputs of the column-parallel projections where
Megatron re-gathers them in backward: those 2 s b h of the replicated terms stay whole; with
`--sp-regather` (`regather`) it re-gathers them too and they are split by t like the rest
(the paper's 34 s b h / t).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from megapar.models.config import LLAMA_TYPES

GIB = 2**30


def paper_layer_bytes(
    s: int, b: int, h: int, a: int, t: int = 1, sp: bool = False, recompute: str = "none"
) -> float:
    """Activation bytes of one layer and micro-batch, Korthikanti et al. 2022 (16-bit)."""
    if recompute == "full":
        return 2 * s * b * h / (t if sp else 1)
    attention = 0.0 if recompute == "selective" else 5 * a * s / h
    if sp:
        return s * b * h * (34 + attention) / t
    return s * b * h * (10 + 24 / t + attention / t)


@dataclass(frozen=True)
class BlockTerms:
    """What one transformer block keeps for backward per token, in units of h elements unless
    named otherwise. The defaults are the paper's (a GPT block with a 4 h FFN)."""

    replicated: float = 4.0
    """Norm inputs and outputs: whole on every tp rank, split by t under SP."""
    gathered: float = 0.0
    """Of those, the ones kept whole under SP too (megapar keeps the column-parallel
    projections' gathered inputs; the paper and `--sp-regather`, re-gathering them in the
    backward, split all)."""
    sliced_too: float = 0.0
    """Of the gathered ones, those whose own slice is kept as well under SP (a MoE layer with
    shared experts: its router reads the MLP norm's output on this rank's s / t tokens, its
    shared experts the gathered copy; MLA with a plain q projection: kv_a reads the attention
    norm's output as it is, q the gathered copy)."""
    split: float = 12.0
    """q, k, v, the attention output and the MLP's intermediates: split by t."""
    norm_stats: float = 4.0
    """fp32 statistics per token (not x h): a LayerNorm's mean and 1/std, an RMSNorm's 1/rms."""
    final_norm: float = 2.0
    """What the last stage's final norm keeps (input and output; RMSNorm also the normalised
    input), and its fp32 statistics per token in `final_stats`."""
    final_stats: float = 2.0
    position_ids: bool = True
    """The first stage keeps int64 position ids (a learned position embedding)."""


def block_terms(config, moe: bool | None = None, cp_method: str | None = None) -> BlockTerms:
    """megapar's blocks for a model config (GPT-2, BERT: LayerNorm + GELU MLP; Llama: RMSNorm +
    SwiGLU), with its FFN width. A mixture of experts' MoE layer (`moe` True, the default for a
    MoE config) counts here only its shared experts' SwiGLU (tp-split like a dense MLP); its
    routed tokens are `plan.experts.routed_bytes`. `moe` False: its dense layers' MLP.
    `cp_method`: the context-parallel attention the blocks run ("ring", "all-gather" or
    "a2a"; None at cp 1), which decides what Multi-head Latent Attention keeps (`_mla_terms`)."""
    f = config.ffn_size / config.hidden_size
    if moe is None:
        moe = bool(getattr(config, "num_moe_layers", 0))
    if moe:  # the routed experts are counted apart (replicated over tp, per routed row)
        f = (config.shared_expert_intermediate_size or 0) / config.hidden_size
    if getattr(config, "mla", False):
        terms = _mla_terms(config, f, cp_method)
    else:
        terms = _dense_terms(config, f)
    if not moe:
        return terms
    # The MoE layer's router reads the MLP norm's output as it is (this rank's s / t tokens under
    # SP, as its routed experts do): only shared experts gather it, and keep the gathered copy.
    if f:
        return replace(terms, sliced_too=terms.sliced_too + 1.0)
    return replace(terms, gathered=terms.gathered - 1.0)


def _dense_terms(config, f: float) -> BlockTerms:
    """GPT-2's and BERT's block (LayerNorm, a GELU MLP of width f h) or Llama's (RMSNorm, a
    SwiGLU of width f h)."""
    if config.model_type in LLAMA_TYPES:
        return BlockTerms(
            replicated=6.0,
            gathered=2.0,
            split=4.0 + 4.0 * f,
            norm_stats=2.0,
            final_norm=3.0,
            final_stats=1.0,
            position_ids=False,
        )
    return BlockTerms(replicated=4.0, gathered=2.0, split=4.0 + 2.0 * f)


def _mla_terms(config, f: float, cp_method: str | None = None) -> BlockTerms:
    """DeepSeek-V3's block (`megapar.models.deepseek`), Llama's norms and SwiGLU (of width f h)
    with Multi-head Latent Attention: whole on every tp rank, the q latent (q_lora_rank: the
    down projection's output and the normalised one), the kv projection's output (kv_lora_rank
    + qk_rope_head_dim) and the normalised kv latent, and the latents entering the tp region
    (q_lora_rank + kv_lora_rank + qk_rope_head_dim: kept gathered under SP, as the MLP's
    input; with a plain q projection, its gathered input too, besides the slice kv_a reads);
    one fp32 1/rms per token and
    norm. Split over tp, this rank's heads' attention: at cp 1 and under the cp all-to-all
    (`cp_method` None or "a2a"), q, k, the value zero-padded to the qk head size and the
    attention kernel's output (qk head size each), and the output projection's input
    (v_head_dim, the output cut back: a copy); under the ring or the all-gather, which take v
    at its own size, q and k (qk head size each), v and the output (v_head_dim each; the output
    projection's input is a view of the output)."""
    h, a = config.hidden_size, config.num_attention_heads
    q_rank, kv_rank, rope = config.q_lora_rank or 0, config.kv_lora_rank, config.qk_rope_head_dim
    latent = q_rank + kv_rank + rope
    qk, v = config.head_size, config.v_head_dim
    attention = 2 * qk + 2 * v if cp_method in ("ring", "all-gather") else 4 * max(qk, v) + v
    return BlockTerms(
        replicated=6.0 + (2 * q_rank + 2 * kv_rank + rope + latent) / h,
        gathered=1.0 + latent / h + (0.0 if q_rank else 1.0),
        sliced_too=0.0 if q_rank else 1.0,  # a plain q's input: kv_a reads its slice
        split=a * attention / h + 4.0 * f,
        norm_stats=3.0 + (1.0 if q_rank else 0.0),
        final_norm=3.0,
        final_stats=1.0,
        position_ids=False,
    )


def layer_bytes(
    s: int,
    b: int,
    h: int,
    a: int,
    t: int = 1,
    sp: bool = False,
    recompute: str = "none",
    act_bytes: int = 2,
    dropout: bool = True,
    fused_attention: bool = False,
    norm_stats: bool = False,
    terms: BlockTerms = BlockTerms(),
    regather: bool = False,
) -> float:
    """Activation bytes of one layer and micro-batch, term by term (see the module docstring).

    With the defaults this equals `paper_layer_bytes`. `norm_stats` adds the norms' saved
    statistics (fp32), which the paper leaves out; `terms` describes another block
    (`block_terms`). `regather` (`--sp-regather`, where it applies: `plan.layouts.regathers`):
    under SP the gathered terms are kept as this rank's slices too."""
    sbh = s * b * h
    rep = sp and t or 1  # replicated terms are split only under SP
    if recompute == "full":
        return sbh * act_bytes / rep
    whole = terms.gathered if sp and t > 1 and not regather else 0.0
    sliced_too = terms.sliced_too if whole else 0.0
    replicated = (
        (terms.replicated - whole + sliced_too) * sbh * act_bytes + (2 * sbh if dropout else 0)
    ) + rep * whole * sbh * act_bytes
    split = terms.split * sbh * act_bytes
    if recompute == "selective":
        scores = 0.0
    elif fused_attention:
        scores = a * s * b * 4  # log-sum-exp (fp32); the kernel output is the proj input
    else:
        scores = a * s * s * b * (2 * act_bytes + 1) if dropout else a * s * s * b * act_bytes
    stats = terms.norm_stats * s * b * 4 / rep if norm_stats else 0.0
    return replicated / rep + (split + scores) / t + stats


def head_bytes(
    s: int,
    b: int,
    h: int,
    vocab_local: int,
    act_bytes: int,
    whole_vocab: int | None = None,
    terms: BlockTerms = BlockTerms(),
    chunk_tokens: int = 0,
    sp_t: int = 1,
    grads_in_forward: bool = True,
) -> float:
    """What the last stage keeps beyond its blocks, per micro-batch: the final norm's input and
    output and the norm's fp32 statistics, and the loss's. Under sequence parallelism (`sp_t`
    = t) the norm's input, its statistics (and Llama's normalised input) are of this rank's
    s / t tokens; its output is kept as the head's gathered (whole-sequence) input.

    With the chunked head and loss (`chunk_tokens` > 0, megapar-train's default) no logits are
    kept: the int64 targets, two boolean masks and the fp32 log-sum-exp per token (and the
    count of labelled tokens); at t = 1 (`whole_vocab` given) where the gradients are made in
    the forward (`grads_in_forward`: one loss in flight at a time, `loss_grads_in_forward`)
    those instead, in fp32: the head input's [s b, h] and the weight's [vocab_local, h] (a
    head bias, BERT's, would add 4 bytes a row: not counted), and the head's input itself is no
    longer kept (the norm's output drops out). Unchunked (0): the softmax of this rank's
    vocabulary slice (fp32, as the paper's 4 s b v / t) and the int64 targets with two boolean
    masks of the vocab-parallel cross-entropy (and the count); at t = 1 (`whole_vocab` = the true
    vocabulary) torch's fused cross-entropy runs instead: it keeps the log-softmax of the true
    (unpadded) vocabulary, the targets and a 4-byte weight sum, no masks."""
    split = (terms.final_norm - 1) / sp_t + 1  # all but the gathered output split under SP
    norm = s * b * split * h * act_bytes + terms.final_stats * s * b * 4 / sp_t
    if chunk_tokens and whole_vocab is not None and grads_in_forward:
        return norm - s * b * h * act_bytes + s * b * h * 4 + vocab_local * h * 4 + 8
    if chunk_tokens:
        return norm + s * b * (8 + 2 + 4) + 8
    if whole_vocab is not None:
        return norm + s * b * (whole_vocab * 4 + 8) + 4 + 8
    return norm + s * b * (vocab_local * 4 + 8 + 2) + 8


def logits_buffer_bytes(
    s: int, b: int, vocab_local: int, act_bytes: int, chunk_tokens: int = 0
) -> float:
    """The transient logits of the LM head's stage in its backward: the fp32 gradient of the
    whole micro-batch's logits (this rank's padded vocabulary), or with the chunked loss
    (`chunk_tokens` > 0) one chunk's, fp32 and, under 16-bit autocast, their 16-bit copy too
    (counted over the padded vocabulary, as the whole's)."""
    if not chunk_tokens:
        return s * b * vocab_local * 4
    return min(chunk_tokens, s * b) * vocab_local * (4 + (act_bytes if act_bytes < 4 else 0))


def document_mask_bytes(s: int, b: int, act_bytes: int) -> float:
    """One additive mask of --attention-mask-type block_causal: [b, 1, s, s] in the attention's
    dtype (`megapar.models.documents.block_causal_bias`), of the whole sequence's s tokens."""
    return b * s * s * act_bytes


def document_masks(config, layers, s: int) -> int:
    """How many block_causal masks a model chunk holding `layers` makes per micro-batch: one
    per distinct sliding window its layers cut a sequence of `s` tokens with (a window of s or
    more cuts nothing: the whole sequence's mask), as `Documents.bias` shares them; GPT-2 has
    no window. 0 for a chunk without blocks."""
    if config.model_type not in LLAMA_TYPES:
        return 1 if len(layers) else 0
    windows = {config.layer_window(i) for i in layers}
    return len({w if w is not None and w < s else None for w in windows})


def embedding_bytes(
    s: int, b: int, h: int, dropout: bool, sp_t: int = 1, terms: BlockTerms = BlockTerms()
) -> float:
    """What the first stage keeps beyond its blocks, per micro-batch: the int64 token ids (s + 1
    per sequence: inputs and labels are views of one tensor), the position ids (a learned
    position embedding) and, with dropout, the embedding dropout mask (1 byte per element;
    split by t under SP)."""
    return (
        (s + 1) * b * 8
        + (s * 8 if terms.position_ids else 0)
        + (s * b * h / sp_t if dropout else 0)
    )


@dataclass
class MemoryBreakdown:
    """Bytes one rank of a pipeline stage needs at the peak of a step."""

    stage: int
    """Pipeline stage this is (the most loaded one is reported)."""
    params: float
    """Parameters (model weights as stored; 16-bit copies when master weights are separate)."""
    grads: float
    """Gradients (fp32)."""
    optimizer: float
    """Adam moments (and fp32 master weights when separate), divided by dp under ZeRO-1."""
    activations: float
    """Activations kept for backward at the peak: in-flight micro-batches x per micro-batch."""
    in_flight: float
    """Micro-batches in flight on this stage at its peak (from the schedule), in stages' worth
    of activations: a chunk counts 1 / V, so 47 chunks' micro-batches at V 2 are 23.5, as
    megapar-train --dry-run counts them."""
    buffers: float
    """Transient bytes at the peak that are not kept for the backward: one chunk's logits on the
    stage with the LM head (the whole logits' fp32 gradient with --loss-chunk-tokens 0), one
    layer's activations rebuilt under recomputation, context parallelism's K/V blocks in flight
    (`estimate.stage_memory`). A dry run lists them as its transients (in its peak, not in
    its device bytes); pipeline messages are in `activations`."""
    master: float = 0.0
    """--offload-optimizer: host copies of the stepped tensors and their gradients."""
    gathered: float = 0.0
    """ZeRO-3: parameters all-gathered at the peak (units in flight)."""
    host: float = 0.0
    """Of params, grads, optimizer and master, the bytes in host memory (offload)."""
    grad_buffers: float = 0.0
    """ZeRO-3: the units' full gradient buffers at the peak (`plan.state.RankState`)."""
    gathered_top: float = 0.0
    """ZeRO-3: of `gathered`, the units gathered at the top of the backward (`plan.process`'s
    first phase: their peak is in the forward, with fewer activations alive)."""
    gathered_end: float = 0.0
    """ZeRO-3: of `gathered`, the units gathered at the end of the backward (`plan.process`'s
    second phase: the peak of the gathered units is in the first)."""
    grad_buffers_top: float = 0.0
    """ZeRO-3: of `grad_buffers`, those alive at the top of the backward (`plan.process`'s
    first phase: their peak is at the backward's end)."""
    gathered_mid: float = 0.0
    """ZeRO-3: the units gathered as a block is reduced inside the backward (`plan.process`'s
    third phase, `zero3_peaks.in_backward`)."""
    grad_buffers_mid: float = 0.0
    """ZeRO-3: the full gradient buffers alive then."""
    reduced_mid: float = 0.0
    """ZeRO-3: of `grad_buffers_mid`, the reduced block's (its reduce-scatter's input)."""
    blocks_done_mid: float = 0.0
    """ZeRO-3: the blocks of the stage's last chunk whose backward finished before then."""
    rebuilt_layer: float = 0.0
    """Under recomputation: the layer each block's backward rebuilds (a block's activations
    without recomputation less those it keeps). Not in `total`: a CPU's heap keeps a second
    place for it (`plan.process`)."""
    sp_saved: float = 0.0
    """Sequence parallelism: the activation bytes it saves on this stage (its activations
    without SP less with it; 0 without SP). Not in `total`: a CPU's heap keeps them as holes
    (`plan.process`)."""
    sp_copies: float = 0.0
    """Sequence parallelism with more than one sequence per micro-batch: its reduce-scatters'
    grouped copies over the blocks held for backward (`estimate.sp_grouped_copies`). Not in
    `total`: transients, which a CPU's heap keeps as holes (`plan.process`)."""

    @property
    def total(self) -> float:
        """Device bytes at the peak (what has to fit the GPU)."""
        return (
            self.params
            + self.grads
            + self.optimizer
            + self.master
            + self.gathered
            + self.grad_buffers
            + self.activations
            + self.buffers
            - self.host
        )

    def as_gib(self) -> dict:
        d = {
            k: v / GIB
            for k, v in asdict(self).items()
            if k not in ("stage", "in_flight", "blocks_done_mid")
        }
        flight = int(self.in_flight) if self.in_flight == int(self.in_flight) else self.in_flight
        return {"stage": self.stage, "in_flight": flight, **d, "total": self.total / GIB}


def state_bytes(params: int, dp: int, zero: int, master_weights: str) -> tuple[float, float, float]:
    """(params, grads, optimizer) bytes for `params` elements on one rank (ZeRO-2 divides the
    gradients by dp too, ZeRO-3 also the parameters).

    master_weights "fp32" is megapar today: fp32 parameters (autocast casts on the fly), fp32
    gradients, Adam's two fp32 moments: 4 + 4 + 8 bytes. "separate" is Megatron's mixed
    precision (and its distributed optimizer): 16-bit parameters, fp32 main gradients,
    fp32 master copy + two moments in the optimizer: 2 + 4 + 12 bytes. ZeRO-1 / the distributed
    optimizer divides the optimizer column by dp."""
    if master_weights == "fp32":
        p, g, o = 4, 4, 8
    elif master_weights == "separate":
        p, g, o = 2, 4, 12
    else:
        raise ValueError(f"unknown master-weights layout {master_weights!r}; use fp32 or separate")
    return (
        params * p / (dp if zero >= 3 else 1),
        params * g / (dp if zero >= 2 else 1),
        params * o / (dp if zero else 1),
    )
