"""A tiny DeepSeek-V3 (Multi-head Latent Attention with a low-rank q, a dense first layer,
three MoE layers with group-limited sigmoid routing, routed_scaling_factor, a shared expert,
the switch loss, the z-loss and the moving e_score_correction_bias) trains the same at tp 2
(MLA's heads split, its down projections whole on each rank), tp 2 with sequence parallelism
(the latents gathered; and with --sp-regather, which keeps this rank's slice of the latents and
re-gathers them once in the backward for q_b and kv_b), pp 2 with full recomputation and dp 2 x ep 2 as one process: losses,
grad norms, router statistics, biases, first-step gradients and final weights, fp32, 1e-5
relative, over three steps (the harness and the serial reference of test_moe_parallel.py and
test_moe_ep.py, given this model). Context parallelism too: cp 2 by each --cp-comm-type (the
ring with selective recomputation, the all-gather, and the all-to-all with full
recomputation; v zero-padded to the qk head size around the ring's and the all-gather's
fused kernel calls, and before the all-to-all),
and tp 2 x cp 2 with sequence parallelism by the all-to-all (a tp rank's two heads, one per cp
rank; the latents gathered over the cp rank's tokens) with YaRN, whose softmax factor goes onto
q before the cp kernels; and cp 2 in bf16 by each comm type (k cast to the activations' dtype
for the cp kernels: the blocks travel in 16 bits; no host sync per micro-batch added)."""

import dataclasses

import pytest
import torch
from sync_count import count_syncs
from test_moe_ep import _engine
from test_moe_ep import _train as _train_ep
from test_moe_parallel import MBS, SEQ, E, _train, check_rank, global_batches, serial_reference
from tp_utils import assert_close

from megapar.comm_count import count_collectives
from megapar.launcher import run_local
from megapar.models import DeepseekV3Config
from megapar.models.blocks import CP_COMM_TYPES


def config() -> DeepseekV3Config:
    return DeepseekV3Config(
        vocab_size=100, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=4, num_attention_heads=4, q_lora_rank=16, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, max_position_embeddings=16,
        make_vocab_size_divisible_by=16, num_local_experts=E, num_experts_per_tok=2,
        n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.0,
        router_aux_loss_coef=0.05, moe_z_loss_coef=0.01, moe_bias_update_rate=0.01)


def yarn_config() -> DeepseekV3Config:
    """`config()` with YaRN rope scaling: the softmax scale times mscale(factor,
    mscale_all_dim)^2, which under cp goes onto q before the cp kernels (their scale is the head
    size's); weights drawn wide enough (std 0.1) that the scale moves the softmax (a cp run
    without the factor is 30 % off in some gradients; at std 0.02 only 1e-5 in the grad norm)."""
    return dataclasses.replace(config(), initializer_range=0.1, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4,
        "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1})


RUNS = [(2, 1, 1, 0, "1f1b"), (2, 1, 1, 0, "1f1b", "none", True), (1, 2, 1, 0, "1f1b", "full")]


def _worker():
    return ([_train(*run, make=config) for run in RUNS]
            + [_train(2, 1, 1, 0, "1f1b", "none", True, make=config, regather=True),
               _train_ep(1, 1, 2, 2, 0, make=config)])


@pytest.fixture(scope="module")
def reference():
    return serial_reference(make=config)


def check(outs, runs, reference) -> None:
    for i, run in enumerate(runs):
        merged = {"weights": {}, "grads": {}}
        for rank, out in enumerate(o[i] for o in outs):
            check_rank(out, f"{run} rank {rank}", reference, merged)
        for key in merged:
            assert set(merged[key]) == set(reference[key]), f"{run}: parameter names differ"
            for name, t in merged[key].items():
                assert_close(t, reference[key][name], what=f"{run} {key} {name}")


def test_deepseek_layouts_match_serial_training(reference):
    assert reference["losses"][-1] < reference["losses"][0]
    assert any(b.abs().sum() > 0 for b in reference["biases"].values())  # the bias moved
    check(run_local(_worker, 2), [*RUNS, "tp 2 SP --sp-regather", "dp 2 x ep 2"], reference)


def _cp_worker(runs, make):
    return [_train(*run[:-1], make=make, comm=run[-1]) for run in runs]


@pytest.mark.parametrize("comm,recompute", [("p2p", "selective"), ("all_gather", "none"),
                                            ("a2a", "full")])
def test_deepseek_cp2_matches_serial_training(reference, comm, recompute):
    """MLA under cp 2 by the ring (p2p; the core recomputed), the all-gather and the
    all-to-all (full recomputation)."""
    runs = [(1, 1, 1, 0, "1f1b", recompute, False, 2, 1, comm)]
    outs = run_local(_cp_worker, 2, runs, config)
    assert all(o[0]["cp_methods"] == {CP_COMM_TYPES[comm]} for o in outs)
    check(outs, runs, reference)


def test_deepseek_tp2_cp2_sp_yarn_matches_serial_training():
    """tp 2 x cp 2 with sequence parallelism by the all-to-all, with YaRN's softmax factor."""
    from megapar.models.llama import rope_softmax_factor

    assert rope_softmax_factor(yarn_config()) > 1.01
    runs = [(2, 1, 1, 0, "1f1b", "none", True, 2, 1, "a2a")]
    outs = run_local(_cp_worker, 4, runs, yarn_config)
    assert all(o[0]["cp_methods"] == {"a2a"} for o in outs)
    check(outs, runs, serial_reference(make=yarn_config))


def _bf16_worker(comms):
    """Per --cp-comm-type at cp 2 in bf16: the first step's loss, and a later step's host syncs
    and collectives at 4 and at 8 micro-batches."""
    from megapar.models import set_cp_comm
    from megapar.training.step import BatchPlan

    out = []
    for comm in comms:
        _, model, _, step = _engine(1, 1, 1, 1, 0, "none", cp=2, precision="bf16", make=config)
        set_cp_comm(model, comm)
        first, second, _ = global_batches()
        both = {k: torch.cat([first[k], second[k]]) for k in first}
        runs = {}
        for m, batch in ((4, first), (8, both)):
            split = BatchPlan(len(batch["input_ids"]), MBS, 1).split(batch, 0)
            loss = step.step(split, 0).loss  # the first step of a shape builds its executor
            with count_syncs() as syncs, count_collectives() as calls:
                step.step(split, 1)
            runs[m] = {"loss": loss, "syncs": syncs,
                       "calls": {(c.op, c.dtype, c.bytes) for c in calls if c.op != "all_reduce"}}
        out.append(runs)
    return out


def test_deepseek_cp2_bf16_sends_16_bit_blocks_and_adds_no_host_sync(reference):
    """Under bf16 autocast MLA's k is fp32 (its rotary part comes from the latent, fp32 after
    the norm's fp32 weight); the cp kernels take it in bf16, as SDPA's autocast does at cp 1
    (an fp32 k was refused by the CPU flash kernel and doubled the all-to-all). The ring's and
    the all-gather's K/V blocks travel in bf16 with k at the qk head size and v at its own
    (MBS x SEQ / 2 tokens x 4 heads x (16 + 12) x 2 bytes), their dK/dV (the ring's sends, the
    all-gather's reduce-scatter of 2 blocks) in fp32; the all-to-all's q, k and v at the qk head
    size (v zero-padded: one head size in one tensor); the loss is within bf16's rounding of
    fp32's; the only host sync per micro-batch is the MoE layers' (`moe.host_counts`)."""
    comms = ["p2p", "all_gather", "a2a"]
    cfg = config()
    heads, qk, v = cfg.num_attention_heads, cfg.head_size, cfg.v_head_dim
    assert (heads, qk, v) == (4, 16, 12)
    tokens = MBS * SEQ // 2  # a cp rank's
    block = tokens * heads * (qk + v) * 2  # bf16 k and v
    head = tokens * heads * qk * 2  # bf16, one of q, k, v or the output at the qk head size
    expected = {
        "p2p": {(op, dtype, size) for op in ("isend", "irecv")
                for dtype, size in ((torch.bfloat16, block), (torch.float32, 2 * block))},
        "all_gather": {("all_gather_into_tensor", torch.bfloat16, block),
                       ("reduce_scatter_tensor", torch.float32, 4 * block)},
        # q, k and v in one, the output in another: what a rank sends of its tokens
        "a2a": {("all_to_all_single", torch.bfloat16, 3 * head),
                ("all_to_all_single", torch.bfloat16, head)},
    }
    for runs in run_local(_bf16_worker, 2, comms):
        for comm, by_m in zip(comms, runs):
            assert abs(by_m[4]["loss"] - reference["losses"][0]) < 1e-2 * reference["losses"][0]
            for m, run in by_m.items():
                assert run["calls"] == expected[comm], (comm, m, run["calls"])
            syncs = [by_m[m]["syncs"] for m in (4, 8)]
            grow = {k for k in syncs[0] | syncs[1] if syncs[0][k] != syncs[1][k]}
            assert len(grow) == 1, (comm, syncs)  # one call site grows with the micro-batches
            (site,) = grow
            assert site[1].startswith("models/moe.py"), (comm, site)
            assert [s[site] for s in syncs] == [3 * 4, 3 * 8], (comm, syncs)  # 3 MoE layers
