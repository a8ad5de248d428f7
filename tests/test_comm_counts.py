"""Communication is counted, not guessed: the collectives of one training step at tp 2 and 4.

Megatron's minimum for tensor parallelism, per transformer layer and micro-batch of b x s
tokens: 2 all-reduces of b x s x h in forward (after attention's and the MLP's row-parallel
projections) and 2 in backward (the input gradients of the fused QKV and of the MLP's first
column-parallel projection). Plus, per micro-batch, the vocab-parallel embedding's forward
all-reduce and the LM head's backward one (b x s x h each) and the vocab-parallel
cross-entropy's 3 all-reduces of b x s (max, target logit, sum of exponentials); per step, one
scalar all-reduce of the squared gradient norm. Nothing else crosses the tp group.
"""

from collections import Counter

import pytest
import torch
from tp_utils import to_device

from megapar.comm_count import count_collectives, summary
from megapar.launcher import run_local
from megapar.mesh import Layout, Mesh
from megapar.models import BertConfig, GPT2Config, LlamaConfig
from megapar.pipeline.partition import build_stage

L, H, MBS, SEQ, M, VOCAB = 3, 32, 2, 8, 2, 96
CONFIGS = {
    "gpt2": dict(vocab_size=VOCAB, n_positions=SEQ, n_embd=H, n_layer=L, n_head=4,
                 make_vocab_size_divisible_by=8, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "bert": dict(vocab_size=VOCAB, hidden_size=H, num_hidden_layers=L, num_attention_heads=4,
                 intermediate_size=2 * H, max_position_embeddings=SEQ,
                 make_vocab_size_divisible_by=8, hidden_dropout_prob=0.0,
                 attention_probs_dropout_prob=0.0),
    # 4 query heads, 2 kv heads: split across tp 2, replicated (each rank its rows) at tp 4
    "llama": dict(vocab_size=VOCAB, hidden_size=H, intermediate_size=2 * H, num_hidden_layers=L,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                  make_vocab_size_divisible_by=8, tie_word_embeddings=False),
}
CONFIG_CLASSES = {"gpt2": GPT2Config, "bert": BertConfig, "llama": LlamaConfig}


def micro_batches(kind: str) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(M):
        ids = torch.randint(0, VOCAB, (MBS, SEQ), generator=gen)
        batch = {"input_ids": ids, "labels": (ids + 1) % VOCAB}
        if kind == "bert":
            batch["attention_mask"] = torch.ones_like(ids)
        out.append(batch)
    return out


def make_step(kind: str, mesh: Mesh, recompute: str = "none", overrides: dict | None = None,
              zero: int = 0, bucket_mb: float | None = None, precision: str = "fp32",
              **step_kwargs):
    """A TrainStep (1F1B) for `kind` on `mesh`; with `bucket_mb` its gradients are reduced over
    cp x dp in buckets of that size."""
    from megapar.optim import LRScheduler, Precision, build_optimizer
    from megapar.pipeline.executor import PipelineExecutor
    from megapar.training.step import TrainStep

    config = (deepseek_config() if kind == "deepseek"
              else CONFIG_CLASSES[kind](**{**CONFIGS[kind], **(overrides or {})}))
    model = build_stage(config, mesh, seed=0, recompute=recompute)
    seq = SEQ // mesh.cp // (mesh.tp if mesh.sequence_parallel else 1)
    executor = PipelineExecutor(model, mesh, "1f1b", (MBS, seq, H))
    optimizer = build_optimizer(model, mesh, 1e-3, 0.1, zero=zero)
    if bucket_mb is not None:
        from megapar.data_parallel import build_grad_sync

        step_kwargs["grad_sync"] = build_grad_sync(model, mesh, zero, bucket_mb)
    return TrainStep(model, mesh, executor, optimizer, LRScheduler(1e-3, 1e-4, 0, 10, "constant"),
                     Precision(precision, mesh.device), 1.0, **step_kwargs)


def _worker(kind: str, tp: int, sequence_parallel: bool = False, adjust=None):
    """The calls of one counted step (after a warm-up); `adjust(model)` first, if given."""
    import torch.distributed as dist

    mesh = Mesh(Layout(tp, 1, 1), dist.get_rank(), sequence_parallel=sequence_parallel)
    step = make_step(kind, mesh)
    if adjust is not None:
        adjust(step.model)
    step.step(to_device(micro_batches(kind), mesh.device), 0)  # warm-up
    with count_collectives() as calls:
        step.step(to_device(micro_batches(kind), mesh.device), 1)
    return calls


def assert_fp32_but_the_norm(calls) -> None:
    """Every collective moves fp32, 4 bytes an element, but the gradient norm's all-reduced sum
    of squares: one fp64 element (`optim.clip.sum_of_squares`), where one crosses ranks."""
    norms = [c for c in calls if c.dtype == torch.float64]
    assert len(norms) <= 1 and all(
        (c.op, c.numel, c.bytes) == ("all_reduce", 1, 8) for c in norms), norms
    assert all(c.dtype == torch.float32 and c.bytes == 4 * c.numel for c in calls
               if c.dtype != torch.float64)


def expected_tp_step(tp: int, kind: str = "gpt2", seq: int = SEQ) -> Counter:
    """`seq`: the tokens of a sequence this rank holds (SEQ / cp under context parallelism)."""
    bsh, bs = MBS * seq * H, MBS * seq
    per_micro_batch = 2 * L + 2 * L + 1 + 1   # layers fwd + bwd, embedding fwd, head bwd
    expected = Counter({("all_reduce", bsh, tp): M * per_micro_batch,
                        ("all_reduce", bs, tp): M * 3,    # vocab-parallel cross-entropy
                        ("all_reduce", 1, tp): 1})        # global gradient norm
    if kind == "llama" and tp > CONFIGS["llama"]["num_key_value_heads"]:
        # kv heads replicated: each rank's share of the k and v weight gradients, summed once
        kv = CONFIGS["llama"]["num_key_value_heads"] * H // CONFIGS["llama"]["num_attention_heads"]
        expected[("all_reduce", L * 2 * kv * H, tp)] += 1
    return expected


@pytest.mark.parametrize("kind", ["gpt2", "bert", "llama"])
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_step_does_megatrons_minimum_all_reduces(kind, tp):
    """Llama too: one input region for q, k, v (also when tp 4 replicates its 2 kv heads) and
    one for the SwiGLU's gate and up projections."""
    for rank_calls in run_local(_worker, tp, kind, tp):
        assert summary(rank_calls) == expected_tp_step(tp, kind)
        assert_fp32_but_the_norm(rank_calls)


def _loss_terms(model) -> None:
    from megapar.models import set_loss_terms

    set_loss_terms(model, 0.1, 1e-3)


def test_label_smoothing_and_z_loss_add_no_collective():
    """--label-smoothing's vocabulary logit sum travels in the target logit's all-reduce (2 x
    b x s numbers); --z-loss's log-sum-exp is the cross-entropy's own: the same collectives."""
    bs = MBS * SEQ
    expected = expected_tp_step(2)
    expected[("all_reduce", bs, 2)] -= M
    expected[("all_reduce", 2 * bs, 2)] += M
    for rank_calls in run_local(_worker, 2, "gpt2", 2, False, _loss_terms):
        assert summary(rank_calls) == expected


def expected_sp_step(kind: str, tp: int, seq: int = SEQ, regather: bool = False) -> Counter:
    """Sequence parallelism: each all-reduce of b x s x h becomes an all-gather of the b x s/tp
    x h slices and a reduce-scatter of b x s x h (the same bytes on the wire), at the same
    places; the vocab-parallel embedding reduce-scatters its output (half an all-reduce's
    bytes; the backward all-gathers the gradient); the LM head gathers its input. Plus one
    all-reduce, per step, of the replicated parameters' partial gradients (LayerNorms,
    row-parallel biases, BERT's head transform, the position and token-type embeddings, which
    see only this rank's positions). `regather` (--sp-regather): per layer and micro-batch two
    more all-gathers of the b x s/tp x h slices in the backward, one per shared input of the
    column-parallel projections (attention's, the MLP's)."""
    bsh, bs, h = MBS * seq * H, MBS * seq, H
    gathers = 2 * L + 2 * L + 1 + 1     # layers fwd + bwd, head fwd, embedding bwd
    gathers += 2 * L if regather else 0  # layers bwd: the inputs re-gathered
    scatters = 2 * L + 2 * L + 1 + 1    # layers fwd + bwd, head bwd, embedding fwd
    embeddings = {"gpt2": SEQ * h, "bert": SEQ * h + 2 * h + 2 * h, "llama": 0}[kind]
    replicated = {"gpt2": L * 6 * h + 2 * h, "bert": L * 6 * h + h * h + 3 * h,
                  "llama": L * 2 * h + h}[kind]  # Llama: two RMSNorms per layer, the final one
    return Counter({("all_gather_into_tensor", bsh // tp, tp): M * gathers,
                    ("reduce_scatter_tensor", bsh, tp): M * scatters,
                    ("all_reduce", bs, tp): M * 3,
                    ("all_reduce", replicated + embeddings, tp): 1,
                    ("all_reduce", 1, tp): 1})


# --- mixed precision: every tp collective of activations in 16 bits, as Megatron's ------------
def deepseek_config():
    """DeepSeek-V3 (MLA, a dense first layer, three MoE layers with a shared expert) at this
    module's sizes: its attention enters the tp region with its latents (q 16 + kv 16 + the
    rotary key's 8 = 40 numbers a token), not the hidden states."""
    from megapar.models import DeepseekV3Config

    return DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=H, intermediate_size=2 * H, moe_intermediate_size=16,
        num_hidden_layers=L + 1, num_attention_heads=4, q_lora_rank=16, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, max_position_embeddings=SEQ,
        make_vocab_size_divisible_by=8, num_local_experts=4, num_experts_per_tok=2, n_group=2,
        topk_group=1, first_k_dense_replace=1)


def _half_worker(kind: str, sequence_parallel: bool, precision: str):
    """One counted step's calls at tp 2 (after a warm-up) under `precision`."""
    import torch.distributed as dist

    mesh = Mesh(Layout(2, 1, 1), dist.get_rank(), sequence_parallel=sequence_parallel)
    step = make_step(kind, mesh, precision=precision)
    step.step(to_device(micro_batches(kind), mesh.device), 0)  # warm-up
    with count_collectives() as calls:
        step.step(to_device(micro_batches(kind), mesh.device), 1)
    from megapar.tensor_parallel.sequence_parallel import sequence_parallel_params

    return calls, sum(p.numel() for p in sequence_parallel_params(step.model))


def expected_half_step(kind: str, sp: bool, half: torch.dtype, replicated: int) -> Counter:
    """(op, elements, dtype) of one step at tp 2 under autocast to `half`: every collective of
    activations or their gradients in `half` (Megatron's 16-bit model moves them so); in fp32
    only what Megatron keeps in fp32 too: the vocab-parallel cross-entropy's per-token
    all-reduces, the replicated parameters' gradient sum under SP and the MoE layers' load
    counts and router statistics (the gradient norm's sum of squares: fp64); `replicated`:
    the elements of the parameters whose gradients SP sums over tp once a step. Llama's:
    `expected_tp_step` / `expected_sp_step`. DeepSeek-V3's L + 1 layers: the MLA's tp region
    carries its latents (b s x 40), every other one b s h; the MoE layers' routed experts are
    whole on each rank, their shared expert split as a dense MLP."""
    f32, tp = torch.float32, 2
    bs, bsh = MBS * SEQ, MBS * SEQ * H
    if kind == "llama":
        counts = expected_sp_step(kind, tp) if sp else expected_tp_step(tp, kind)
        wide = {bs, 1} | ({replicated} if sp else set())
        return Counter({(op, n, torch.float64 if n == 1 else f32 if n in wide else half): k
                        for (op, n, _), k in counts.items()})
    layers, latent, moe = L + 1, MBS * SEQ * 40, L
    out = Counter({("all_reduce", bs, f32): M * 3, ("all_reduce", 1, torch.float64): 1})
    if not sp:  # forward: 2 row-parallel outputs a layer, the embedding; backward: the
        # column-parallel inputs (the latents, the MLP's), the head's
        out[("all_reduce", bsh, half)] = M * (2 * layers + 1 + layers + 1)
        out[("all_reduce", latent, half)] = M * layers
        return out
    # forward: the MLPs' inputs and the head's gathered, the latents gathered, the row-parallel
    # outputs and the embedding's reduce-scattered; backward the reverse
    out[("all_gather_into_tensor", bsh // tp, half)] = M * (layers + 1 + 2 * layers + 1)
    out[("all_gather_into_tensor", latent // tp, half)] = M * layers
    out[("reduce_scatter_tensor", bsh, half)] = M * (2 * layers + 1 + layers + 1)
    out[("reduce_scatter_tensor", latent, half)] = M * layers
    out[("all_reduce", 4 + 1, f32)] = M * moe  # the switch loss's load counts
    out[("all_reduce", moe * (4 + 4), f32)] = 1  # the step's router statistics
    out[("all_reduce", replicated, f32)] = 1
    return out


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("kind", ["llama", "deepseek"])
def test_mixed_precision_tp_collectives_move_16_bits(kind, precision):
    """Under autocast megapar keeps fp32 weights, so the norms' outputs, the embedding's output
    and the residual stream are fp32; where they enter a tp collective they travel in the
    autocast dtype (`mappings.to_wire_dtype`), as Megatron's 16-bit activations: the
    column-parallel inputs' gradients (SP: the norm outputs' all-gathers and their gradients'
    reduce-scatters), MLA's latents, the embedding's reduction, the head input's. Each call
    at its dtype's bytes (elements x 2). Without the cast (before it) 4 bytes: the backward's
    two a layer, the embedding's and the head's."""
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    for sp in (False, True):
        for rank_calls, replicated in run_local(_half_worker, 2, kind, sp, precision):
            got = Counter((c.op, c.numel, c.dtype) for c in rank_calls)
            want = expected_half_step(kind, sp, half, replicated)
            if precision == "fp16":  # the loss scaler's found-inf flag, MAX over the world
                want[("all_reduce", 1, torch.float32)] += 1
            assert got == want, (sp, got)
            assert all(c.bytes == c.numel * c.dtype.itemsize for c in rank_calls)


def _sp_worker(kind: str, tp: int):
    """The counted step's calls under SP, without and with --sp-regather."""
    from megapar.models import set_sp_regather

    out = [_worker(kind, tp, True)]
    out.append(_worker(kind, tp, True, lambda model: set_sp_regather(model, True)))
    return out


@pytest.mark.parametrize("kind", ["gpt2", "bert", "llama"])
def test_sequence_parallel_step_collectives(kind):
    """Also with --sp-regather: its re-gathers, issued in the same order on every tp rank."""
    tp = 2
    runs = run_local(_sp_worker, tp, kind, tp)
    for plain, regathered in runs:
        assert summary(plain) == expected_sp_step(kind, tp)
        assert summary(regathered) == expected_sp_step(kind, tp, regather=True)
    order = [[(c.op, c.numel) for c in regathered] for _, regathered in runs]
    assert all(o == order[0] for o in order)


# --- data parallelism: ZeRO-1's distributed optimizer ------------------------------------------
def _dp_worker(pp: int, dp: int, zero: int):
    """One counted step; returns the calls and the gradient buffer's (padded) size."""
    import torch.distributed as dist

    mesh = Mesh(Layout(1, pp, dp), dist.get_rank())
    step = make_step("gpt2", mesh, zero=zero, bucket_mb=0.01)
    grad_sync = step.grad_sync
    step.step(micro_batches("gpt2"), 0)  # warm-up
    with count_collectives(mesh.device) as calls:
        step.step(micro_batches("gpt2"), 1)
    from megapar.dryrun.world import held_bytes

    numel = sum(grad_sync.buffer_sizes().values())  # allocated or not (ZeRO-2: not)
    state = sum(t.numel() for st in step.optimizer.inner.state.values() for k, t in st.items()
                if k != "step")
    return {"calls": calls, "buffer": numel, "buckets": len(grad_sync.buckets),
            "held": held_bytes(step.model, step.optimizer),
            "deferred": sum(b.padded for b in grad_sync.buckets if b.deferred),
            "n_deferred": sum(b.deferred for b in grad_sync.buckets),
            "params": sum(p.numel() for p in step.model.parameters()), "state": state,
            "stage": mesh.pp_rank}


def _reduced(calls, dp: int) -> list:
    return [c for c in calls if c.group_size == dp and c.op not in ("isend", "irecv")]


@pytest.mark.parametrize("pp,zero", [(1, 1), (2, 1), (1, 2), (2, 2)])
def test_zero_reduce_scatters_and_all_gathers_the_buffer(pp, zero):
    """dp=2: plain dp all-reduces the gradient buffer (2 units of traffic per element); the
    distributed optimizer reduce-scatters it and all-gathers the parameters (also 2 units), no
    broadcast, and all-reduces only scalars over dp (the squared gradient norm and the loss);
    each rank keeps 1/dp of the Adam state. With pp=2 the tied embedding's gradient is summed
    over the first and last stage (before the reduce-scatter) in one all-reduce of its size.
    ZeRO-2 reduce-scatters every micro-batch (m x the buffer, but the tied embedding's deferred
    bucket once, after its sum over the stages), all-gathers the parameters once and holds 1/dp
    of the gradient buffer between steps."""
    dp = 2
    plain = run_local(_dp_worker, pp * dp, pp, dp, 0)
    sharded = run_local(_dp_worker, pp * dp, pp, dp, zero)
    embedding = 96 * H  # vocab padded to 96 (a multiple of 8), unsharded at tp=1
    for base, out in zip(plain, sharded):
        assert out["buckets"] > 1
        # the buffer is padded: each bucket to a multiple of dp
        assert base["params"] == base["buffer"] <= out["buffer"] < base["buffer"] + dp * out["buckets"]
        calls = _reduced(out["calls"], dp)
        scatters = [c for c in calls if c.op == "reduce_scatter_tensor"]
        gathers = [c for c in calls if c.op == "all_gather_into_tensor"]
        m = M if zero == 2 else 1  # reductions per step of a bucket that is not deferred
        rounds = m * (out["buffer"] - out["deferred"]) + out["deferred"]
        assert sum(c.bytes for c in scatters) == 4 * rounds               # input: whole bucket
        assert sum(c.bytes for c in gathers) == 4 * out["buffer"] // dp   # input: own slice
        assert len(gathers) == out["buckets"]
        assert len(scatters) == m * (out["buckets"] - out["n_deferred"]) + out["n_deferred"]
        assert (out["n_deferred"] > 0) == (pp > 1 and zero == 2 or pp > 1 and zero == 1)
        base_calls = _reduced(base["calls"], dp)
        # (with pp=2 the pipeline group has size 2 too: the executor's scalar broadcasts and the
        # norm's all-reduce over pp appear in both runs); with pp=2 the first stage's slice of
        # the tied embedding's reduced gradient goes to the last stage, in one broadcast over
        # the embedding group of the slice's size (`equal_tied_grads`)
        broadcasts = summary(c for c in calls if c.op == "broadcast")
        equalised = [("broadcast", embedding // dp, 2)] if pp > 1 else []
        assert broadcasts == summary(c for c in base_calls if c.op == "broadcast") + \
            Counter(equalised)
        assert all(c.numel == 1 for c in calls if c.op == "broadcast" and c.numel != embedding // dp)
        scalars = [c for c in calls if c.op == "all_reduce" and c.numel == 1]
        # the loss, (pp > 1: the norm over pp,) and the norm over dp
        assert len(scalars) == 2 + (pp > 1)
        assert len(scalars) == len([c for c in base_calls
                                    if c.op == "all_reduce" and c.numel == 1]) + 1
        tied = [c for c in out["calls"] if c.op == "all_reduce" and c.numel > 1]
        assert [c.numel for c in tied] == ([embedding] if pp > 1 else [])
        # plain dp: all-reduces of the buckets, the buffer's size in all (plus the tied sync)
        assert sum(c.numel for c in base_calls if c.op == "all_reduce" and c.numel > 1) == \
            base["buffer"] + (embedding if pp > 1 else 0)
        # optimizer memory: exp_avg + exp_avg_sq for 1/dp of the stage's elements (+ padding)
        assert base["state"] == 2 * base["params"]
        assert abs(out["state"] - base["state"] / dp) <= 2 * out["buckets"] * dp
        assert base["held"]["grads"] == 4 * base["buffer"]
        assert out["held"]["grads"] == 4 * out["buffer"] // (dp if zero == 2 else 1)


# --- context parallelism -----------------------------------------------------------------------
def _cp_worker(tp: int, cp: int, sequence_parallel: bool, runs: list[tuple]):
    """For each (kind, recompute[, --cp-comm-type]): the calls of one counted step, and the
    gradient buffer's size."""
    import torch.distributed as dist

    from megapar.models import set_cp_comm

    mesh = Mesh(Layout(tp, 1, 1, cp=cp), dist.get_rank(), sequence_parallel=sequence_parallel)
    out = []
    for kind, recompute, *comm in runs:
        step = make_step(kind, mesh, recompute, bucket_mb=1000.0)  # one bucket
        set_cp_comm(step.model, comm[0] if comm else "auto")
        step.step(micro_batches(kind), 0)  # warm-up
        with count_collectives(mesh.device) as calls:
            step.step(micro_batches(kind), 1)
        out.append((calls, sum(b.numel() for b in step.grad_sync.buffers.values())))
    return out


def expected_cp_step(kind: str, tp: int, cp: int, buffer: int, sp: bool = False,
                     recompute: str = "none", comm: str = "auto") -> Counter:
    """Per layer and micro-batch, with this rank's K/V block of kv = 2 x b x s/cp x (kv heads
    / tp) x head size elements: the ring (GPT-2, BERT) exchanges cp - 1 K/V blocks forward and
    cp - 1 K/V plus cp dK/dV blocks backward (each an isend and an irecv of kv elements); the
    all-gather (grouped-query Llama) all-gathers the K/V forward and again backward and
    reduce-scatters their gradients (cp x kv in). Recomputation repeats the forward's. Per
    micro-batch one all-reduce of the loss's (sum, count) over cp; per step the gradient buffer
    is all-reduced over cp once. The tp collectives are those of s / cp tokens.

    `comm` "a2a" (the all-to-all): per layer and micro-batch one all-to-all of q, k and v
    (b x s/cp x (heads + 2 x kv heads) / tp x head size elements; kv heads expanded to the
    query heads where they do not divide over cp) and one of the output (b x s/cp x heads / tp
    x head size) forward, the same two backward, recomputation repeating the forward's."""
    seq = SEQ // cp
    expected = Counter() if tp == 1 else \
        expected_sp_step(kind, tp, seq) if sp else expected_tp_step(tp, kind, seq)
    heads, kv_heads = 4, CONFIGS[kind].get("num_key_value_heads", 4)
    kv = 2 * MBS * seq * (kv_heads // tp if kv_heads % tp == 0 else kv_heads) * (H // heads)
    forwards = 2 if recompute in ("full", "selective") else 1  # the attention's, per layer
    if comm == "a2a":
        q_heads = heads // tp
        sent_kv = kv_heads // tp if kv_heads % tp == 0 and (kv_heads // tp) % cp == 0 else q_heads
        per_head = MBS * seq * (H // heads)
        expected[("all_to_all_single", (q_heads + 2 * sent_kv) * per_head, cp)] += \
            M * L * (forwards + 1)
        expected[("all_to_all_single", q_heads * per_head, cp)] += M * L * (forwards + 1)
    elif kind == "llama":
        expected[("all_gather_into_tensor", kv, cp)] += M * L * (forwards + 1)
        expected[("reduce_scatter_tensor", cp * kv, cp)] += M * L
    else:
        for op in ("isend", "irecv"):
            expected[(op, kv, cp)] += M * L * (forwards * (cp - 1) + (cp - 1) + cp)
    expected[("all_reduce", 2, cp)] += M
    expected[("all_reduce", buffer, cp)] += 1
    return expected


@pytest.mark.parametrize("tp,cp,sp", [(1, 2, False), (1, 4, False), (2, 2, False), (2, 2, True)])
def test_cp_step_messages_and_bytes_are_the_analytic_ones(tp, cp, sp):
    """GPT-2 and BERT (ring), grouped-query Llama (all-gather); at cp 2 also with full
    recompute, which repeats the attention forward's messages in backward."""
    runs = [(kind, "none") for kind in ("gpt2", "bert", "llama")]
    if (tp, cp) == (1, 2):
        runs += [("gpt2", "full"), ("llama", "full")]
    for rank_results in run_local(_cp_worker, tp * cp, tp, cp, sp, runs):
        for (kind, recompute), (calls, buffer) in zip(runs, rank_results):
            assert summary(calls) == expected_cp_step(kind, tp, cp, buffer, sp, recompute), \
                (kind, recompute)
            assert_fp32_but_the_norm(calls)


@pytest.mark.parametrize("tp", [1, 2])
def test_cp_a2a_step_all_to_alls_and_bytes_are_the_analytic_ones(tp):
    """--cp-comm-type a2a at cp 2: GPT-2 and Llama (2 kv heads: unexpanded at tp 1, each tp
    rank's one replicated at tp 2), at tp 1 also with full recompute; nothing else crosses cp
    but the loss's and the gradients' all-reduces."""
    runs = [("gpt2", "none", "a2a"), ("llama", "none", "a2a")]
    if tp == 1:
        runs.append(("llama", "full", "a2a"))
    for rank_results in run_local(_cp_worker, tp * 2, tp, 2, False, runs):
        for (kind, recompute, comm), (calls, buffer) in zip(runs, rank_results):
            assert summary(calls) == expected_cp_step(kind, tp, 2, buffer, False, recompute,
                                                      comm), (kind, recompute)
            assert_fp32_but_the_norm(calls)


# --- expert tensor parallelism: one MoE layer's tp collectives --------------------------------
def _etp_worker():
    """One MoE layer (Qwen3-MoE-shaped: 4 experts, top 2, no shared experts) at tp 2 with each
    expert split over tp, without and with sequence parallelism (with a padding mask): each
    forward's and backward's calls in order, and the host syncs of both."""
    import torch.distributed as dist
    from sync_count import count_syncs

    from megapar.models import Qwen3MoeConfig
    from megapar.models.moe import MoE
    from megapar.tensor_parallel.init import initialize, normal_init

    config = Qwen3MoeConfig(vocab_size=64, hidden_size=H, intermediate_size=2 * H,
                            moe_intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=16, max_position_embeddings=SEQ,
                            num_local_experts=4, num_experts_per_tok=2)
    out = []
    for sp in (False, True):
        mesh = Mesh(Layout(2, 1, 1), dist.get_rank(), sequence_parallel=sp, expert_tp=2)
        moe = MoE(config, mesh).train()
        initialize(moe, 0, normal_init(), mesh.tp_rank)
        seq = SEQ // 2 if sp else SEQ
        x = torch.randn(MBS, SEQ, H, generator=torch.Generator().manual_seed(1))
        x = x[:, (mesh.tp_rank * seq if sp else 0):][:, :seq].clone().requires_grad_()
        mask = torch.ones(MBS, seq) if sp else None
        with count_syncs() as syncs:
            with count_collectives() as forward:
                y = moe(x, mask)
            with count_collectives() as backward:
                y.sum().backward()
        out.append(([(c.op, c.numel, c.dtype, c.group_size) for c in forward],
                    [(c.op, c.numel, c.dtype, c.group_size) for c in backward], syncs))
    return config, out


def test_expert_tensor_parallel_moe_layer_collectives():
    """Per MoE layer and micro-batch, each expert split over tp 2 issues exactly the tp
    collectives `plan.experts.expert_tp_collectives` counts, fp32, in the same order on both
    ranks: without SP an all-reduce of the output (forward), of the combine weights' and of the
    tokens' gradients (backward) — Megatron's one all-reduce of the experts' output, and the
    input gradient's, as a dense row- / column-parallel MLP; under SP all-gathers of the
    weights + choices + mask and of the tokens and a reduce-scatter of the output (plus the
    switch loss's existing all-reduce of the E + 1 load counts), the reverse in backward. The
    one host sync stays the expert loop's reading of its counts (`moe.host_counts`)."""
    from megapar.plan.experts import expert_tp_collectives

    runs = run_local(_etp_worker, 2)
    config, (plain, split) = runs[0]
    tokens = MBS * SEQ
    for (*got, syncs), sp in ((plain, False), (split, True)):
        want = expert_tp_collectives(config, tokens, 2, sp, padded=sp)
        stats = [("all_reduce", config.num_local_experts + 1)] if sp else []
        assert sum(syncs.values()) == 1 and all("moe.py" in w for _, w in syncs), syncs
        for calls, expected in zip(got, (want[0] + stats, want[1])):
            assert [(op, n) for op, n, _, _ in calls] == expected, (sp, calls)
            assert all(d == torch.float32 and g == 2 for _, _, d, g in calls)
    assert runs[0][1] == runs[1][1]  # both ranks: the same calls in the same order

