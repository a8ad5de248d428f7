"""The planner's figures against published ones: the recipes' parameter counts (the model
cards and papers), the FLOPs per token of MFU against Megatron's / PaLM's 6 N + 12 L h s, the
tp collectives per layer against Megatron's tensor parallelism (Shoeybi et al. 2019:
two all-reduces of s b h in the forward, two in the backward), and where megapar differs
from them, by how much (docs/guides/planner.md, "Checked against published figures")."""

import dataclasses
import json
from pathlib import Path

import pytest

from megapar.cli.train import main as train_main
from megapar.models.flops import training_flops_per_token
from megapar.models.recipes import resolve_model
from megapar.plan import Candidate, Problem
from megapar.plan.params import model_params
from megapar.plan.timing import chunk_times

ROOT = Path(__file__).resolve().parents[1]

# published sizes: GPT-3 (Brown et al. 2020, table 2.1), Llama 3 8B / 70B (model cards),
# Mixtral 8x7B (Jiang et al. 2024), GPT-2 1.5B (1,557,611,200 in transformers)
PUBLISHED = {"gpt3-175b": 174.6e9, "llama-8b": 8.03e9, "llama-70b": 70.6e9,
             "mixtral-8x7b": 46.7e9, "gpt2-1.5b": 1.558e9}


@pytest.mark.parametrize("recipe", sorted(PUBLISHED))
def test_recipes_have_their_published_parameter_counts(recipe):
    assert model_params(resolve_model(recipe)) == pytest.approx(PUBLISHED[recipe], rel=1e-3)


# active parameters per token: Mixtral 8x7B 12.9B (Jiang et al. 2024), Qwen3-30B-A3B 3.3B
# (its model card)
ACTIVE = {"mixtral-8x7b": 12.9e9, "qwen3-30b-a3b": 3.3e9}


@pytest.mark.parametrize("recipe", sorted(ACTIVE))
def test_moe_recipes_say_their_published_active_parameters(recipe, capsys):
    """megapar-plan's first line (and --json) gives a mixture of experts' active parameters,
    the whole model's less the E - k routed experts a token is not sent to: it gave the total
    alone."""
    from megapar.cli.plan import main as plan_main

    config = resolve_model(recipe)
    active = model_params(config) - config.idle_expert_params
    assert active == pytest.approx(ACTIVE[recipe], rel=2e-2)  # Qwen's "3.3B" is 3.353B
    assert active == {"mixtral-8x7b": 12_879_925_248, "qwen3-30b-a3b": 3_353_032_704}[recipe]
    k, e = config.num_experts_per_tok, config.num_local_experts
    args = ["--model", recipe, "--gpus", "8", "--global-batch-size", "8", "--seq-len", "512",
            "--top", "1", "--micro-batch-sizes", "1", "--schedules", "1f1b", "--zero-stages", "1"]
    plan_main(args)
    first = capsys.readouterr().out.splitlines()[0]
    assert f"M parameters ({active / 1e6:,.1f}M active per token: {k} of {e} experts)" in first
    plan_main([*args, "--json"])
    assert json.loads(capsys.readouterr().out)["active_params"] == active


@pytest.mark.parametrize("recipe", ["gpt3-175b", "llama-8b", "llama-70b", "mixtral-8x7b"])
def test_flops_per_token_are_6n_plus_12_l_h_s_without_the_lookups(recipe):
    """MFU's count is 6 N + 12 L h s (Megatron's / PaLM's appendix B) with N the parameters
    a token's matmuls use: the embedding lookup's (and the learned position embedding's),
    biases and norms left out, a tied head counted once, a mixture of experts' active
    parameters (2 of 8 experts: Mixtral's published 12.9B active). 6 N over all parameters
    counts Llama 3 8B's untied embedding as a matmul: 6 % more."""
    config, s = resolve_model(recipe), 2048
    n, h, layers = model_params(config), config.hidden_size, config.num_layers
    if recipe == "gpt3-175b":  # tied: the head's matmul uses the word embedding's parameters
        lookups = config.n_positions * h
    else:  # untied: the input embedding is a lookup
        lookups = config.vocab_size * h
    if recipe == "mixtral-8x7b":  # 6 of 8 experts idle per token; the router counted as h x E
        idle = layers * 6 * 3 * h * config.intermediate_size
        assert n - idle == pytest.approx(12.9e9, rel=3e-3)
        n -= idle
    # biases and norms are no matmuls: GPT's 13 h a block (4 h of norms, 9 h of biases) and
    # its final norm's 2 h; Llama's two RMSNorms a block and its final one
    vectors = (13 * layers + 2) * h if recipe == "gpt3-175b" else (2 * layers + 1) * h
    used = n - lookups - vectors
    assert training_flops_per_token(config, s) == pytest.approx(6 * used + 12 * layers * h * s,
                                                                rel=1e-12)
    if recipe == "llama-8b":
        whole = 6 * model_params(config) + 12 * layers * h * s
        assert whole / training_flops_per_token(config, s) == pytest.approx(1.0654, abs=1e-3)


def _tp_bytes(recipe, sp, master_weights, s=64, b=2, precision="bf16", regather=False,
              recompute="none", etp=1):
    """Bytes the planner's tp collectives of one micro-batch move on tp 2 (a ring's 2 (n-1)/n
    is 1 there), read back from its seconds at 8 Gbit/s and no latency."""
    p = Problem(resolve_model(recipe), 2, global_batch=b, seq_len=s, precision=precision,
                master_weights=master_weights, intra_gbps=8.0, latency_us=0.0,
                sp_regather=regather)
    ((chunk,),) = chunk_times(p, Candidate(tp=2, mbs=b, sp=sp, recompute=recompute, etp=etp))
    return chunk.tp * 1e9


def _tiny_model(tmp_path, recipe, layers=None):
    """`recipe`, or for "shared-experts" mixtral-tiny with a shared expert of 32 (split over
    tp like a dense MLP), for "gpt2-dropout" gpt2-tiny with a residual dropout of 0.1, written
    to a config file; with `layers`, its first `layers` layers (a config file too)."""
    from recipe_layers import write_with_layers

    if recipe not in ("shared-experts", "gpt2-dropout") and layers is None:
        return recipe
    name = {"shared-experts": "mixtral-tiny", "gpt2-dropout": "gpt2-tiny"}.get(recipe, recipe)
    shared = {"shared_expert_intermediate_size": 32} if recipe == "shared-experts" else {}
    shared |= {"resid_pdrop": 0.1} if recipe == "gpt2-dropout" else {}
    return write_with_layers(tmp_path / "model.json", name,
                             layers or resolve_model(name).num_layers, **shared)


def _dry_run_tp(capsys, model, *flags, s=64, b=2):
    """Rank 0's tp collectives ({op: {"bytes": ...}}) in megapar-train --dry-run of `model` at
    tp 2, bf16, one micro-batch of `b` x `s`, with `flags`."""
    argv = ["--model", model, "--tp", "2", "--world-size", "2", "--dry-run", "--seq-len",
            str(s), "--micro-batch-size", str(b), "--global-batch-size", str(b), "--precision",
            "bf16", "--dry-run-ranks", "0", "--json", *flags]
    assert train_main(argv) == 0
    return json.loads(capsys.readouterr().out.splitlines()[0])["comm"]["tp"]


@pytest.mark.parametrize("sp", [False, True])
def test_tp_collectives_are_megatrons_four_per_layer_at_the_wires_dtypes(sp):
    """Per layer 2 all-reduces of s b h in the forward and 2 in the backward (SP: as many
    all-gathers and reduce-scatters, the same ring bytes), plus the vocab-parallel
    embedding's (SP: a reduce-scatter, its gradient all-gathered) and the head input's, all
    at 2 bytes: Megatron's
    16-bit model (--master-weights separate), and megapar-train's fp32 weights under autocast
    too (its fp32 norm outputs, embedding output and residual stream are cast to the autocast
    dtype where they enter a tp collective; until then the backward's two moved 4 bytes, 1.5 x
    the paper's per layer)."""
    s, b, h, layers = 64, 2, 64, 4
    sbh = s * b * h
    ends = 2  # SP: the embedding's reduce-scatter and its gradient's all-gather, the head's
    # gather and its gradient's reduce-scatter, each half an all-reduce's ring
    for master_weights in ("separate", "fp32"):
        assert _tp_bytes("gpt2-tiny", sp, master_weights) == pytest.approx(
            layers * 4 * sbh * 2 + ends * sbh * 2, rel=1e-12)


@pytest.mark.parametrize("recipe", ["gpt2-tiny", "llama-tiny", "mixtral-tiny", "shared-experts",
                                    "deepseek-v3-tiny"])
def test_tp_bytes_are_what_a_dry_run_counts(capsys, tmp_path, recipe):
    """megapar-train --dry-run of tp 2 in bf16 counts the real code's all-reduces: the planner's
    bytes, plus the vocab-parallel cross-entropy's three fp32 all-reduces per token (its max,
    sum of exponentials and target logit: latency, not timed by the planner). A MoE layer
    (mixtral-tiny: every layer) reduces only its attention's over tp, its routed experts being
    whole on every rank; with shared experts (split over tp) also its MLP's, as a dense layer.
    DeepSeek-V3's MLA reduces its latents' gradient, not h's
    (`test_mla_tp_bytes_are_its_latents_as_a_dry_run_counts`)."""
    s, b = 64, 2
    model = _tiny_model(tmp_path, recipe)
    counted = _dry_run_tp(capsys, model)["all_reduce"]["bytes"]
    planned = _tp_bytes(model, False, "fp32", s, b)
    assert counted == pytest.approx(planned + 3 * s * b * 4, rel=1e-12)
    if recipe == "mixtral-tiny":  # 4 layers x 2 all-reduces of 64 x 2 x 64, all bf16
        assert planned == pytest.approx(4 * 2 * 8192 * 2 + 2 * 8192 * 2, rel=1e-12)


@pytest.mark.parametrize("recipe", ["gpt2-tiny", "llama-tiny", "deepseek-v3-tiny"])
def test_sp_tp_bytes_are_what_a_dry_run_counts(capsys, recipe):
    """Under SP at tp 2 the planner's ring bytes are half the dry run's all-gather and
    reduce-scatter bytes (it counts each call's whole s b h tensor, of which a rank sends
    (t - 1) / t), every one in bf16: the blocks', the embedding's reduce-scatter
    and its gradient's all-gather, the head input's gather and its gradient's reduce-scatter
    (until 2026-12-03 the planner left the embedding's gradient out). DeepSeek-V3's MLA
    gathers its latents (72 a token in deepseek-v3-tiny) where Megatron's attention gathers
    h: 303,104 bytes counted and planned (the planner had priced h: 294,912)."""
    s, b = 64, 2
    tp = _dry_run_tp(capsys, recipe, "--sequence-parallel")
    counted = (tp["all_gather"]["bytes"] + tp["reduce_scatter"]["bytes"]) / 2
    assert counted == pytest.approx(_tp_bytes(recipe, True, "fp32", s, b), rel=1e-12)


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("recipe, etp, recompute", [
    ("gpt2-tiny", 1, "full"), ("gpt2-dropout", 1, "full"), ("bert-tiny", 1, "full"),
    ("shared-experts", 1, "full"), ("mixtral-tiny", 2, "none"), ("shared-experts", 2, "full"),
    ("deepseek-v3-tiny", 2, "full")])
def test_recomputed_and_expert_tp_bytes_are_what_a_dry_run_counts(capsys, tmp_path, recipe,
                                                                   etp, recompute, sp):
    """Full recomputation re-runs a layer's forward only up to the last tensor its backward
    reads (torch.utils.checkpoint's early stop): a layer whose MLP (or shared experts) is split
    over tp stops before that MLP's output all-reduce (SP: reduce-scatter), so a dense layer
    moves 5 all-reduces of s b h, not 6, unless something after it keeps a tensor: a residual
    dropout's mask (GPT-2 and GPT-3 at resid_pdrop 0.1, which the planner priced at 5 until
    2026-12-04), BERT's post-norm input. With the routed experts split over tp under SP, their
    combine weights and choices ([T, 2k] fp32) are all-gathered in the forward as well as
    reduce-scattered in the backward. The planner's tp bytes at tp 2 in bf16 equal the dry
    run's (less the cross-entropy's three fp32 all-reduces a token)."""
    # 2 of each model's 4 layers (deepseek-v3-tiny: its dense one and a MoE one): a layer's
    # bytes are the same whatever their count, and the dry run rehearses half as many
    s, b, layers = 64, 2, 2
    model = _tiny_model(tmp_path, recipe, layers)
    tp = _dry_run_tp(capsys, model, "--recompute", recompute, "--expert-tensor-parallel-size",
                     str(etp), *(["--sequence-parallel"] if sp else []))
    if sp:
        counted = (tp["all_gather"]["bytes"] + tp["reduce_scatter"]["bytes"]) / 2
    else:
        counted = tp["all_reduce"]["bytes"] - 3 * s * b * 4
    planned = _tp_bytes(model, sp, "fp32", s, b, recompute=recompute, etp=etp)
    assert counted == pytest.approx(planned, rel=1e-12)
    if recipe in ("gpt2-tiny", "gpt2-dropout"):  # a layer's (2 + 2 + 1 recomputed) s b h,
        # and the ends' 2; SP: the recompute's 2 all-gathers and 1 reduce-scatter, half a
        # ring's bytes each; with the dropout the MLP's reduction recomputed too
        per_layer = 6 if recipe == "gpt2-dropout" else (5.5 if sp else 5)
        assert planned == pytest.approx((layers * per_layer + 2) * s * b * 64 * 2, rel=1e-12)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("sp", ["none", "sp", "regather"])
@pytest.mark.parametrize("q_lora_rank", [32, None])
def test_mla_tp_bytes_are_its_latents_as_a_dry_run_counts(capsys, tmp_path, q_lora_rank, sp,
                                                          precision):
    """DeepSeek-V3's Multi-head Latent Attention at tp 2 (deepseek-v3-tiny: h 64, 4 layers, the
    first dense, the others MoE with a shared expert split over tp): its down projections are
    whole on every rank, and what enters its tp region is their output, the q latent (32), the
    normed kv latent (32) and the shared rotary key (8), one tensor of 72 a token, not h: its
    gradient all-reduced in the backward (SP: all-gathered in the forward, reduce-scattered in
    the backward). With a plain q projection (q_lora_rank None) the kv latent and rotary key
    (40) enter in one collective and q's input (h) in its own. The output projection's and the
    MLP's collectives carry h. So a layer moves 3 h + 72 (plain q: 4 h + 40) a token where
    Megatron's moves 4 h, plus the ends' 2 h (the embedding's and the head's), in the
    activations' dtype (bf16: 2 bytes, `to_wire_dtype`; fp32: 4). --sp-regather re-gathers, in
    the backward, each MLP's input (h) and the attention's inputs (72: the latents, of whose one
    re-gather q_b and kv_b read their columns; plain q: 40 + h), each half a ring's bytes. The
    planner's bytes equal the dry run's (less the vocab-parallel cross-entropy's three fp32
    all-reduces a token); it priced h a token, 294,912 bytes in bf16 against the 303,104
    (plain q: 335,872) counted at its 4 layers."""
    # 2 of its 4 layers (the dense one and a MoE one): a layer's bytes are the same whatever
    # their count, and the dry run rehearses half as many
    s, b, h, layers = 64, 2, 64, 2
    from recipe_layers import write_with_layers

    model = write_with_layers(tmp_path / "mla.json", "deepseek-v3-tiny", layers,
                              q_lora_rank=q_lora_rank)
    argv = ["--model", model, "--tp", "2", "--world-size", "2", "--dry-run", "--seq-len",
            str(s), "--micro-batch-size", str(b), "--global-batch-size", str(b), "--precision",
            precision, "--dry-run-ranks", "0", "--json"]
    argv += {"none": [], "sp": ["--sequence-parallel"],
             "regather": ["--sequence-parallel", "--sp-regather"]}[sp]
    assert train_main(argv) == 0
    tp = json.loads(capsys.readouterr().out.splitlines()[0])["comm"]["tp"]
    if sp == "none":
        counted = tp["all_reduce"]["bytes"] - 3 * s * b * 4
        assert "all_gather" not in tp and "reduce_scatter" not in tp
    else:
        counted = (tp["all_gather"]["bytes"] + tp["reduce_scatter"]["bytes"]) / 2
    planned = _tp_bytes(str(model), sp != "none", "fp32", s, b, precision, sp == "regather")
    assert counted == pytest.approx(planned, rel=1e-12)
    latents = 72 if q_lora_rank else 40 + h
    regathered = (h + latents) / 2 if sp == "regather" else 0
    width = layers * (3 * h + latents + regathered) + 2 * h
    assert planned == pytest.approx(s * b * width * (2 if precision == "bf16" else 4), rel=1e-12)


@pytest.mark.parametrize("recipe, cp, tp", [("llama-70b", 8, 8), ("llama-8b", 4, 4),
                                              ("gpt2-1.5b", 4, 1), ("gpt2-124m", 2, 2)])
def test_cp_bytes_against_ring_and_all_gather_attention(recipe, cp, tp):
    """Per layer and micro-batch, the K/V traffic of context parallelism against the published
    schemes, with K/V = 2 b (s / cp) (kv heads / t) d elements per rank: ring attention (Liu
    et al. 2023; Megatron-LM's --cp-comm-type p2p) sends it cp - 1 times in the forward;
    all-gather attention (Llama 3, Dubey et al. 2024; Megatron's allgather) gathers cp of them
    once. megapar's backward: the ring sends K/V again cp - 1 times and dK/dV (fp32) cp times
    (back to their owner); the all-gather gathers again and reduce-scatters cp fp32 blocks."""
    from megapar.plan.context_parallel import cp_method, cp_traffic

    config = resolve_model(recipe)
    s, b = 131072, 1
    problem = Problem(config, tp * cp, seq_len=s, global_batch=8)
    heads = config.n_head if recipe.startswith("gpt2") else config.num_attention_heads
    kv_heads = heads if recipe.startswith("gpt2") else config.num_key_value_heads
    d = config.hidden_size // heads
    block = 2 * b * (s // cp) * max(kv_heads // tp, 1) * d  # elements of a rank's K and V
    traffic = cp_traffic(problem, Candidate(tp=tp, cp=cp, mbs=b))
    if kv_heads < heads:  # grouped-query: Llama 3's all-gather
        assert cp_method(config) == "all-gather"
        assert traffic["forward"] == [("all-gather", 1, block * 2)]
        assert traffic["backward"] == [("all-gather", 1, block * 2),
                                       ("reduce-scatter", 1, cp * block * 4)]
    else:
        assert cp_method(config) == "ring"
        assert traffic["forward"] == [("send", cp - 1, block * 2)]
        assert traffic["backward"] == [("send", cp - 1, block * 2), ("send", cp, block * 4)]


def test_model_state_bytes_against_the_zero_paper():
    """ZeRO (Rajbhandari et al. 2020): mixed-precision Adam holds 2 + 2 + 12 = 16 bytes a
    parameter; ZeRO-1 / 2 / 3 divide 12 / 14 / 16 of them by r. megapar-train (fp32 master):
    4 + 4 + 8, the same 16, of which ZeRO-1 / 2 / 3 divide 8 / 12 / 16 (its fp32 weights are
    the parameters, not the optimizer's copy). --master-weights separate (Megatron's: 16-bit
    parameters, fp32 main gradients and master): 2 + 4 + 12 = 18, of which 12 / 16 / 18."""
    from megapar.plan.memory import state_bytes

    n, r = 1000, 8
    fp32 = {0: 16, 1: 8 + 8 / r, 2: 4 + 12 / r, 3: 16 / r}  # the paper's at ZeRO-0 and ZeRO-3
    separate = {0: 18, 1: 6 + 12 / r, 2: 2 + 16 / r, 3: 18 / r}
    for zero in range(4):
        assert sum(state_bytes(n, r, zero, "fp32")) / n == pytest.approx(fp32[zero], rel=1e-12)
        assert sum(state_bytes(n, r, zero, "separate")) / n == pytest.approx(separate[zero],
                                                                             rel=1e-12)


def test_in_flight_and_bubbles_of_the_guides_table():
    """Korthikanti et al.: the first stage holds p micro-batches under 1F1B, p (1 + (p-1)/(p v))
    interleaved; Narayanan et al.: idle (p-1)/(m+p-1), interleaved (p-1)/(v m+p-1); Qi et al.:
    ZB-H1 idles (p-1)(t_F + t_B - t_W), a third of 1F1B's at equal F, B, W. Simulated."""
    from megapar.plan import pipeline

    sizes = [("1f1b", 16, 64, 1), ("interleaved", 16, 64, 2), ("interleaved", 8, 32, 2),
             ("interleaved", 4, 16, 4), ("zb-h1", 8, 32, 1)]
    for name, p, m, v in sizes:
        counts, source = pipeline.in_flight(name, p, m, v)
        published = p if v == 1 else p * (1 + (p - 1) / (p * v))
        assert source == "simulated" and counts[0] == pytest.approx(published, rel=1e-12)
    assert pipeline.bubble("1f1b", 8, 32) == (pytest.approx(7 / 39, rel=1e-9), "simulated")
    assert pipeline.bubble("interleaved", 8, 32, 2) == (pytest.approx(7 / 71, rel=1e-9),
                                                        "simulated")
    assert pipeline.bubble("zb-h1", 8, 32) == (pytest.approx(7 / (32 * 3 + 7), rel=1e-9),
                                               "simulated")


@pytest.mark.parametrize("master_weights, nbytes", [("fp32", 4), ("separate", 2)])
def test_zero1_gathers_the_parameters_at_their_own_size(master_weights, nbytes):
    """ZeRO-1's all-gather after the step (exposed; its reduce-scatter hidden behind a slow
    backward here) moves (r-1)/r of the parameters: fp32 in bf16 under megapar-train's fp32
    weights (the blocks' linear weights in 16 bits, buckets of their own), 2 bytes under
    --master-weights separate (Megatron's distributed optimizer gathers its bf16 parameters)."""
    from megapar.plan import estimate
    from megapar.plan.fp8 import half_weights
    from megapar.plan.params import stage_params

    config, r, gbps = resolve_model("gpt2-tiny"), 8, 800.0
    p = Problem(config, r, global_batch=r, seq_len=64, precision="bf16",
                master_weights=master_weights, intra_gbps=gbps, latency_us=0.0, efficiency=1e-6)
    c = Candidate(dp=r, zero=1)
    n = stage_params(config, 1, 1)[0]
    gathered = n * nbytes - (2 * half_weights(p, c, 0) if master_weights == "fp32" else 0)
    exposed = estimate(p, c).comm_s["dp"]
    assert exposed == pytest.approx((r - 1) / r * gathered * 8 / (gbps * 1e9), rel=1e-9)


@pytest.mark.parametrize("recipe", ["gpt2-tiny", "llama-tiny", "mixtral-tiny"])
def test_the_step_s_tp_gradient_sum_under_sp_is_what_a_dry_run_counts(capsys, recipe):
    """Under SP each tp rank's gradient of a replicated parameter is its tokens' share, summed
    over tp once a step: the dry run's tp all-reduces are that (fp32: GPT-2's norms,
    row-parallel biases and position embedding; Llama's norms; Mixtral's norms, routers and
    routed experts), the loss's three per-token ones and a MoE layer's per-micro-batch expert
    loads (E + 1 floats). The plan adds the sum's ring to the step, exposed."""
    from megapar.plan.estimate import estimate, tp_sync_bytes, tp_sync_seconds

    s, b = 64, 2
    argv = ["--model", recipe, "--tp", "2", "--world-size", "2", "--dry-run", "--seq-len",
            str(s), "--micro-batch-size", str(b), "--global-batch-size", str(b), "--precision",
            "bf16", "--dry-run-ranks", "0", "--json", "--sequence-parallel"]
    assert train_main(argv) == 0
    rank = json.loads(capsys.readouterr().out.splitlines()[0])
    counted = rank["comm"]["tp"]["all_reduce"]["bytes"]
    config = resolve_model(recipe)
    loads = config.num_layers * (config.num_local_experts + 1) * 4 if recipe == "mixtral-tiny" \
        else 0
    p = Problem(config, 2, global_batch=b, seq_len=s, precision="bf16", intra_gbps=8.0,
                latency_us=0.0)
    c = Candidate(tp=2, mbs=b, sp=True)
    synced = tp_sync_bytes(p, c, 0)
    assert counted == synced + 3 * s * b * 4 + loads
    if recipe == "mixtral-tiny":  # the routed experts: 4 layers x 4 x 3 x 64 x 64 x 4 bytes
        assert synced > 4 * 4 * 3 * 64 * 64 * 4
    assert tp_sync_seconds(p, c) == pytest.approx(synced * 1e-9, rel=1e-12)  # ring of 2, 1 GB/s
    assert tp_sync_bytes(p, dataclasses.replace(c, sp=False), 0) == 0
    with_sync = estimate(p, c)
    assert with_sync.comm_s["tp"] == pytest.approx(
        chunk_times(p, c)[0][0].tp + tp_sync_seconds(p, c), rel=1e-9)


@pytest.mark.parametrize("zero", [1, 2])
def test_the_tp_gradient_sum_under_zero_is_this_rank_s_pieces(capsys, zero):
    """Under ZeRO-2 the gradients are this dp rank's pieces by the step's tp sum: half of
    llama-tiny's norms at dp 2 (ZeRO-1: all of them), as the dry run counts them besides the
    loss's three per-token all-reduces."""
    from megapar.plan.estimate import tp_sync_bytes

    s, b = 64, 2
    argv = ["--model", "llama-tiny", "--tp", "2", "--dp", "2", "--world-size", "4", "--dry-run",
            "--seq-len", str(s), "--micro-batch-size", str(b), "--global-batch-size", str(2 * b),
            "--precision", "bf16", "--dry-run-ranks", "0", "--json", "--sequence-parallel",
            "--zero", str(zero)]
    assert train_main(argv) == 0
    rank = json.loads(capsys.readouterr().out.splitlines()[0])
    p = Problem(resolve_model("llama-tiny"), 4, global_batch=2 * b, seq_len=s, precision="bf16")
    synced = tp_sync_bytes(p, Candidate(tp=2, dp=2, mbs=b, sp=True, zero=zero), 0)
    assert synced == (4 * 2 + 1) * 64 * 4 / (2 if zero == 2 else 1)
    assert rank["comm"]["tp"]["all_reduce"]["bytes"] == synced + 3 * s * b * 4
