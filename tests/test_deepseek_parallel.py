"""A tiny DeepSeek-V3 (Multi-head Latent Attention with a low-rank q, a dense first layer,
three MoE layers with group-limited sigmoid routing, routed_scaling_factor, a shared expert,
the switch loss, the z-loss and the moving e_score_correction_bias) trains the same at tp 2
(MLA's heads split, its down projections whole on each rank), tp 2 with sequence parallelism
(the latents gathered), pp 2 with full recomputation and dp 2 x ep 2 as one process: losses,
grad norms, router statistics, biases, first-step gradients and final weights, fp32, 1e-5
relative, over three steps (the harness and the serial reference of test_moe_parallel.py and
test_moe_ep.py, given this model)."""

from test_moe_ep import _train as _train_ep
from test_moe_parallel import E, _train, check_rank, serial_reference
from tp_utils import assert_close

from megapar.launcher import run_local
from megapar.models import DeepseekV3Config


def config() -> DeepseekV3Config:
    return DeepseekV3Config(
        vocab_size=100, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=4, num_attention_heads=4, q_lora_rank=16, kv_lora_rank=16,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, max_position_embeddings=16,
        make_vocab_size_divisible_by=16, num_local_experts=E, num_experts_per_tok=2,
        n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.0,
        router_aux_loss_coef=0.05, moe_z_loss_coef=0.01, moe_bias_update_rate=0.01)


RUNS = [(2, 1, 1, 0, "1f1b"), (2, 1, 1, 0, "1f1b", "none", True), (1, 2, 1, 0, "1f1b", "full")]


def _worker():
    return ([_train(*run, make=config) for run in RUNS]
            + [_train_ep(1, 1, 2, 2, 0, make=config)])


def test_deepseek_layouts_match_serial_training():
    reference = serial_reference(make=config)
    assert reference["losses"][-1] < reference["losses"][0]
    assert any(b.abs().sum() > 0 for b in reference["biases"].values())  # the bias moved
    outs = run_local(_worker, 2)
    for i, run in enumerate([*RUNS, "dp 2 x ep 2"]):
        merged = {"weights": {}, "grads": {}}
        for rank, out in enumerate(o[i] for o in outs):
            check_rank(out, f"{run} rank {rank}", reference, merged)
        for key in merged:
            assert set(merged[key]) == set(reference[key]), f"{run}: parameter names differ"
            for name, t in merged[key].items():
                assert_close(t, reference[key][name], what=f"{run} {key} {name}")
