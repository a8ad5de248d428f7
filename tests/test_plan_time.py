"""The planner's step time: every stage costs what it holds (the LM head on its stage, however
few blocks that stage has), the simulator is fed each chunk's own costs, the FLOPs are the
models' own (`megapar.models.flops`, checked against torch's count of a real forward and
backward), and MFU never exceeds the efficiency it is computed against."""

import dataclasses

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megapar.mesh import Layout, Mesh
from megapar.models import LlamaConfig, build_model
from megapar.models.flops import (
    kv_heads_per_rank,
    matmul_flops,
    training_flops_per_token,
)
from megapar.models.recipes import resolve_model
from megapar.pipeline.schedules import placement_of, schedule_actions
from megapar.pipeline.simulate import Costs, action_times
from megapar.plan import Candidate, Problem, estimate
from megapar.plan.timing import chunk_times

# grouped-query attention with a head size of its own (not hidden / heads)
GQA = LlamaConfig(
    vocab_size=300,
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
)


@pytest.mark.parametrize(
    "config",
    [resolve_model("gpt2-tiny"), resolve_model("llama-tiny"), resolve_model("bert-tiny"), GQA],
    ids=["gpt2", "llama", "bert", "llama-gqa-head-dim"],
)
def test_matmul_flops_equal_torch_s_count_of_a_real_step(config):
    """Forward: torch's FlopCounterMode over the whole model (every matmul, the attention
    kernel's included) equals tokens x (layers x (block + attention) + head) plus the logits'
    two gradient products: the chunked loss (the default) at tp 1 makes the head input's and
    weight's gradients in the forward, of the real vocabulary's columns only (the padding's are
    never computed); backward twice the rest (the embedding's gradient is a scatter, no
    matmul), so the logits are computed once in forward + backward."""
    # on the meta device (no memory) attention runs as its math decomposition, whose matmuls
    # the counter sees (torch's CPU flash kernel is not in its table: it would count none)
    model = build_model(config, Mesh.virtual(Layout(1, 1, 1), rank=0, device="meta"))
    b, s = 2, 32
    ids = torch.zeros((b, s), dtype=torch.long, device="meta")
    with FlopCounterMode(display=False) as forward:
        loss = model(None, {"input_ids": ids, "labels": ids})
    with FlopCounterMode(display=False) as backward:
        loss.backward()
    f = matmul_flops(config, s)
    head = matmul_flops(config, s, padded=False).head
    logits = 2 * config.hidden_size * config.vocab_size  # of the head, its gradients moved
    rest = b * s * (config.num_layers * f.layer() + head)
    assert forward.get_total_flops() == rest + 2 * b * s * logits
    assert backward.get_total_flops() == 2 * rest - 2 * b * s * logits
    # MFU's count: the same at tp 1, with the vocabulary unpadded
    padded = (f.head - matmul_flops(config, s, padded=False).head) * 3
    assert (
        training_flops_per_token(config, s) == 3 * (config.num_layers * f.layer() + f.head) - padded
    )


def test_llama_counts_swiglu_and_grouped_query_heads():
    """llama-8b: SwiGLU's three h x f products and k / v of 8 kv heads, not GPT-2's 2 h f and
    4 h^2 (18 % more per block)."""
    c = resolve_model("llama-8b")
    h, f, kv = c.hidden_size, c.intermediate_size, c.kv_heads * c.head_size
    assert matmul_flops(c, 8192).block == 2 * (2 * h * h + 2 * h * kv + 3 * h * f)
    assert matmul_flops(c, 8192).block / (2 * (4 * h * h + 2 * h * f)) == pytest.approx(
        1.18, abs=0.01
    )


@pytest.mark.parametrize("tp", [1, 2, 3, 6])
def test_kv_heads_per_rank_are_those_the_built_attention_projects(tp):
    """6 query heads on 2 kv heads: tp 2 splits the kv heads, tp 3 and 6 keep them whole and a
    rank projects the rows its query heads use (tp 3: rank 1's heads 2, 3 use both)."""
    rows = []
    for rank in range(tp):
        mesh = Mesh.virtual(Layout(tp, 1, 1), rank=rank, device="meta")
        block = next(iter(build_model(GQA, mesh, range(1), False, False).layers.values()))
        k = block.attn.k
        rows.append(k.rows[1] - k.rows[0] if hasattr(k, "rows") else k.weight.shape[0])
    assert max(rows) == kv_heads_per_rank(GQA, tp) * GQA.head_size
    assert kv_heads_per_rank(GQA, 3) == 2


def test_the_last_stage_counts_the_head_though_it_has_fewer_blocks():
    """gpt2-124m at pp 8 (blocks 2,2,2,2,1,1,1,1): the last stage's one block and the head
    (vocabulary 50304 x 768, 4.5 blocks' FLOPs at 1024 tokens) is the slowest; the step is its
    m micro-batches at least, and dp 8 is faster (the plan used to rank this pp 8 first, at
    61.3 % MFU against an efficiency of 60 %). The chunked loss (the default) at tp 1 makes the
    head's gradients in its forward, so the forward holds the head three times; the step is
    the last stage's 256 micro-batches and the fill, and the MFU is Megatron's FLOPs per token
    (Narayanan et al. 2021, eq. 3: 72 L h^2 (1 + s / 6h + V / 12hL) per token) over it; the
    whole logits (--loss-chunk-tokens 0) is a little faster."""
    p = Problem(resolve_model("gpt2-124m"), 8, global_batch=256, seq_len=1024)
    c = Candidate(1, 8, 1, 1, "zb-h1")
    times = chunk_times(p, c)
    totals = [sum(x.total for x in row) for row in times]
    assert max(totals) == totals[-1] > 2.5 * totals[0]
    fl = matmul_flops(p.config, 1024)
    rate = p.peak_tflops * 1e12 * p.efficiency
    assert times[-1][0].forward == pytest.approx(1024 * (fl.layer() + 3 * fl.head) / rate)
    e, flat = estimate(p, c), estimate(p, Candidate(1, 1, 8, 1))
    assert e.step_s >= 256 * totals[-1]
    assert e.mfu <= p.efficiency and flat.step_s < e.step_s
    assert e.step_s == pytest.approx(256 * totals[-1], rel=0.01)
    L, h, s, V = 12, 768, 1024, 50257
    megatron = 72 * L * h**2 * (1 + s / (6 * h) + V / (12 * h * L))
    whole = estimate(dataclasses.replace(p, loss_chunk_tokens=0), c)
    assert whole.step_s < e.step_s
    for run in (e, whole):
        assert run.mfu == pytest.approx(256 * s * megatron / (run.step_s * 8 * p.peak_tflops * 1e12))


@pytest.mark.parametrize(
    "schedule,v", [("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-v", 2), ("dualpipev", 2)]
)
def test_the_simulator_gets_each_chunk_s_own_costs(schedule, v):
    """The step's pipeline part is megapar's simulator run with every chunk's own F / B / W
    (the head on the last virtual stage: rank 0's second chunk in the V placement, the last
    rank's last chunk when interleaved), not one stage's costs for all."""
    p = Problem(resolve_model("gpt2-124m"), 4, global_batch=32, seq_len=1024)
    c = Candidate(1, 4, 1, 1, schedule, v)
    times = chunk_times(p, c)
    head_rank = 0 if placement_of(schedule) == "v" else 3
    assert max(range(4), key=lambda r: times[r][-1].total) == head_rank
    m = 32
    costs = [
        [
            Costs(
                1e3 * x.forward,
                1e3 * (x.backward_input + x.backward_weight),
                bwd_input_ms=1e3 * x.backward_input,
                bwd_weight_ms=1e3 * x.backward_weight,
            )
            for x in row
        ]
        for row in times
    ]
    ends = action_times(
        [schedule_actions(schedule, 4, m, s, v) for s in range(4)], costs, placement_of(schedule)
    )
    pipe = max(stage[-1][1] for stage in ends)  # seconds (the costs in ms)
    e = estimate(p, c)
    exposed = e.comm_s["pp"] + e.comm_s["dp"]
    assert e.bubble_source == "simulated"
    assert e.step_s - exposed == pytest.approx(pipe, rel=2e-3)
    busy = sum(m * sum(x.total for x in row) for row in times) / 4
    assert e.bubble == pytest.approx(1 - busy / (e.step_s - exposed), abs=2e-3)


GRID = [
    ("gpt2-124m", 8, 256, 1024),
    ("gpt2-1.5b", 16, 64, 1024),
    ("llama-1b", 16, 256, 4096),
    ("llama-8b", 8, 64, 8192),
    ("bert-large", 8, 256, 512),
    ("gpt3-175b", 64, 128, 2048),
]


@pytest.mark.parametrize("model,gpus,batch,seq", GRID, ids=[g[0] for g in GRID])
def test_mfu_never_exceeds_the_efficiency(model, gpus, batch, seq):
    """MFU = model FLOPs / (step x GPUs x peak) and the step is at least the busiest rank's
    FLOPs / (peak x efficiency), so MFU <= efficiency over every layout and option; and MFU x
    step x GPUs x peak / tokens is the FLOPs per token megapar-train logs its MFU with."""
    from megapar.plan import plan

    p = Problem(resolve_model(model), gpus, global_batch=batch, seq_len=seq)
    estimates, _ = plan(p, micro_batch_sizes=(1, 2), virtual_stages=(2,))
    assert estimates
    worst = max(estimates, key=lambda e: e.mfu)
    assert worst.mfu <= p.efficiency, worst.candidate.label()
    e = estimates[0]
    assert e.mfu * e.step_s * gpus * p.peak_tflops * 1e12 / (batch * seq) == pytest.approx(
        training_flops_per_token(p.config, seq)
    )


def test_recomputation_and_efficiency_scale_the_step():
    """Full recomputation adds a forward of the blocks; halving the efficiency doubles the
    compute. The head's compute is 3 of its matmuls per token (the chunked loss at tp 1 makes
    its gradients in the forward: the logits computed once)."""
    p = Problem(resolve_model("gpt2-124m"), 8, global_batch=64, seq_len=1024)
    none, full = (estimate(p, Candidate(1, 1, 8, 1, recompute=r)) for r in ("none", "full"))
    fl = matmul_flops(p.config, 1024)
    layers = 12 * fl.layer()
    assert full.compute_s / none.compute_s == pytest.approx(
        (4 * layers + 3 * fl.head) / (3 * layers + 3 * fl.head)
    )
    slow = estimate(dataclasses.replace(p, efficiency=0.3), Candidate(1, 1, 8, 1))
    assert slow.compute_s == pytest.approx(2 * none.compute_s)


def test_every_layout_s_step_is_its_compute_exposed_comm_and_idle():
    """The parts of a step the plan prints add up to it, layout by layout: compute + exposed
    communication (tp, cp, ep of the busiest rank's micro-batches; pp, dp and the rest outside
    the pipeline) + the busiest rank's idle time, so the communication's share lies in [0, 1].
    A tiny Mixtral (mixtral-tiny at 3 layers, hidden 64, 4 experts of 96, top 2) on 8 GPUs,
    every layout, bubbles simulated and by formula: the bubble spread over the communication
    gave 1,152 of these 1,644 estimates shares over 1."""
    from megapar.plan import Shared, enumerate_candidates

    config = dataclasses.replace(resolve_model("mixtral-tiny"), num_hidden_layers=3,
                                 intermediate_size=96)
    p = Problem(config, 8, global_batch=16, seq_len=64)
    valid, _ = enumerate_candidates(p, micro_batch_sizes=(1, 2))
    assert {c.ep for c in valid} == {1, 2, 4} and {c.pp for c in valid} == {1, 2}
    shared = Shared()
    estimates = [
        (estimate(p, c, simulate=simulate, shared=shared), simulate)
        for c in valid
        for simulate in ((False, True) if c.pp > 1 else (False,))
    ]
    assert len(estimates) > 500
    over = [(e.candidate.label(), simulate, e.comm_share) for e, simulate in estimates
            if not 0 <= e.comm_share <= 1 or min(e.comm_s.values()) < 0]
    assert not over, (len(over), over[:3])
    for e, simulate in estimates:
        parts = e.compute_s + sum(e.comm_s.values()) + e.idle_s
        assert e.idle_s >= 0 and parts == pytest.approx(e.step_s, rel=1e-9), (
            e.candidate.label(), simulate)


def test_split_experts_divide_their_flops_by_tp_and_add_their_reductions_to_tp():
    """With the routed experts split over tp (etp = tp) a tp rank computes I / tp of each of
    its k experts a token (the router's E outputs stay whole), and each MoE layer adds, per
    micro-batch, its output's all-reduce forward and the tokens' (and combine weights')
    backward to the tp column: ring all-reduces in the activations' dtype (bf16 here: the
    residual stream is cast where it enters the collective), the combine weights' gradient in
    fp32."""
    from megapar.plan.timing import ring_seconds

    cfg = resolve_model("mixtral-8x7b")
    h, k, size = cfg.hidden_size, cfg.num_experts_per_tok, cfg.expert_size
    whole, split = (matmul_flops(cfg, 4096, 2, etp=e).block for e in (1, 2))
    assert whole - split == pytest.approx(2 * 3 * h * k * size / 2)
    p = Problem(cfg, 64, global_batch=256, seq_len=4096)
    one, two = (chunk_times(p, Candidate(2, 1, 32, 1, ep=8, etp=e, zero=1))[0][0]
                for e in (1, 2))
    tokens, layers = 4096, cfg.num_layers
    assert p.act_bytes == 2
    wide = ring_seconds(2, tokens * h * 2, p.intra_gbps, p.latency_us)
    weights = ring_seconds(2, tokens * k * 4, p.intra_gbps, p.latency_us)
    assert two.tp - one.tp == pytest.approx(layers * (2 * wide + weights))


def test_the_tied_copies_equalised_after_a_sharded_or_rounding_reduction_are_counted():
    """At pp > 1 the tied embedding's reduced gradient goes from the first stage to the last
    where its sum over the stages precedes a dp reduction that shards it (ZeRO: a slice of
    1 / (dp x cp)) or rounds it (fp16's 16-bit reduction: all of it), one broadcast a step
    (`pipeline.tied.equal_tied_grads`); the fp32 all-reduce sums after it and sends none."""
    from megapar.plan.params import piece_counts

    cfg = resolve_model("gpt2-124m")
    p = Problem(cfg, 8, global_batch=32, seq_len=1024)
    c = Candidate(1, 2, 4, 1, "1f1b", 1)
    nbytes = piece_counts(cfg, 1, p.config_json).tied_copy * 4
    assert nbytes == 4 * 50304 * 768  # the vocabulary padded to a multiple of 128

    def pp_seconds(problem, zero):
        return estimate(problem, dataclasses.replace(c, zero=zero)).comm_s["pp"]

    def broadcast(n):
        return n * 8 / (p.intra_gbps * 1e9) + p.latency_us * 1e-6

    base = pp_seconds(p, 0)
    for zero in (1, 2, 3):
        assert pp_seconds(p, zero) - base == pytest.approx(broadcast(nbytes / 4))
    fp16 = dataclasses.replace(p, precision="fp16")
    assert pp_seconds(fp16, 0) - pp_seconds(dataclasses.replace(p, precision="bf16"), 0) == \
        pytest.approx(broadcast(nbytes))
