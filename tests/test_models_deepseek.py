"""DeepSeek-V3 (Multi-head Latent Attention, group-limited sigmoid routing with its
e_score_correction_bias and routed_scaling_factor, shared experts, first_k_dense_replace dense
layers) built by megapar equals transformers' DeepseekV3ForCausalLM: logits, loss and every
gradient (fp32, 1e-5 relative), in two variants: a low-rank q (q_lora_rank) with interleaved
rope and YaRN (its frequencies, attention_factor and softmax mscale), and a plain q projection
with rotate-half rope, no groups and no renormalisation. And the transformers directory
imported by `import_hf` at tp 2 and exported back by `export_hf` (the router bias with it) is
transformers' model again.
"""

import pytest
import torch
import transformers
from tp_utils import assert_close, make_mesh

from megapar.checkpoint.hf import HFReader, load_hf_weights
from megapar.checkpoint.hf_names import hf_parameter_names
from megapar.mesh import Layout
from megapar.models import DeepseekV3, DeepseekV3Config
from megapar.models.config import ConfigError

VOCAB, SEQ, B = 64, 12, 3
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
            n_routed_experts=8, num_experts_per_tok=3, kv_lora_rank=16, qk_rope_head_dim=8,
            qk_nope_head_dim=8, v_head_dim=12, first_k_dense_replace=1,
            max_position_embeddings=64)
VARIANTS = {
    "lora-interleave-yarn": dict(
        q_lora_rank=24, n_group=4, topk_group=2, rope_interleave=True,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 16, "mscale": 1.0,
                         "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}),
    "plain-q-rotate-half": dict(q_lora_rank=None, n_group=1, topk_group=1, norm_topk_prob=False,
                                rope_interleave=False),
}


def hf_dir(root, variant: str) -> str:
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(
        transformers.DeepseekV3Config(**BASE, **VARIANTS[variant]))
    with torch.no_grad():  # non-trivial norms, router and bias, so a mapping mistake shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith("gate.weight"):
                p.normal_(0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)
    path = root / variant
    model.save_pretrained(path)
    return str(path)


def batch():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (B, SEQ), generator=gen)
    labels = torch.cat([ids[:, 1:], torch.full((B, 1), -100)], dim=1)  # HF shifts inside
    return ids, labels


def hf_grad(hf_params: dict, config, name: str) -> torch.Tensor:
    """transformers' gradient of megapar parameter `name` (its fused experts by layer)."""
    if ".mlp.experts." in name:
        layer, kind = name.split(".")[1], name.rsplit(".", 1)[1]
        return hf_params[f"model.layers.{layer}.mlp.experts.{kind}_proj"].grad
    (hf_name,) = hf_parameter_names(config, name)
    return hf_params[hf_name].grad


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_deepseek_v3_equals_transformers(tmp_path, variant):
    path = hf_dir(tmp_path, variant)
    reader = HFReader(path)
    config = reader.config
    assert isinstance(config, DeepseekV3Config) and config.num_moe_layers == 1
    model = DeepseekV3(config, make_mesh(1))
    assert load_hf_weights(model, reader) == []
    bias = model.layers["1"].mlp.router.bias
    assert bias.abs().sum() > 0 and torch.equal(bias, reader.canonical("layers.1.mlp.router.bias"))
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(
        path, attn_implementation="eager").train()
    ids, labels = batch()
    ref = hf(input_ids=ids, labels=ids)
    ref.loss.backward()
    model.eval()
    with torch.no_grad():
        assert_close(model(None, {"input_ids": ids})[..., :VOCAB], ref.logits, what="logits")
    model.train()
    loss = model(None, {"input_ids": ids, "labels": labels})
    assert_close(loss, ref.loss, what="loss")
    loss.backward()
    hf_params = dict(hf.named_parameters())
    names = [n for n, _ in model.named_parameters()]
    assert len(names) == len(hf_params)
    assert any("q_a" in n for n in names) == (variant == "lora-interleave-yarn")
    for name, p in model.named_parameters():
        grad = p.grad[tuple(slice(0, n) for n in p.full_shape)]  # the vocabulary unpadded
        assert_close(grad, hf_grad(hf_params, config, name), what=f"grad of {name}")


def test_deepseek_v3_import_at_tp2_exports_back_to_transformers(tmp_path):
    from megapar.checkpoint.convert import import_hf
    from megapar.checkpoint.export import export_hf

    path = hf_dir(tmp_path, "lora-interleave-yarn")
    ckpt, initialised = import_hf(path, tmp_path / "ckpt", tp=2, pp=1, progress=False)
    assert initialised == []
    out = export_hf(ckpt, tmp_path / "out")
    back = transformers.DeepseekV3ForCausalLM.from_pretrained(str(out)).eval()
    src = transformers.DeepseekV3ForCausalLM.from_pretrained(path).eval()
    assert back.config.rope_parameters == src.config.rope_parameters
    for (n, a), (m, b) in zip(src.state_dict().items(), back.state_dict().items(), strict=True):
        assert n == m and torch.equal(a, b), n
    ids, _ = batch()
    with torch.no_grad():
        assert torch.equal(back(input_ids=ids).logits, src(input_ids=ids).logits)


def test_deepseek_v3_config_refusals():
    config = DeepseekV3Config.from_dict(dict(BASE, model_type="deepseek_v3", n_group=4,
                                             topk_group=2, q_lora_rank=24))
    assert config.num_local_experts == 8 and config.shared_expert_intermediate_size == 16
    assert DeepseekV3Config.from_dict(config.to_dict()) == config
    config.validate(Layout(tp=2))
    with pytest.raises(ConfigError, match="n_group 3"):
        DeepseekV3Config.from_dict(dict(config.to_dict(), n_group=3)).validate(Layout())
    config.validate(Layout(tp=2, cp=2))  # MLA under cp


def test_deepseek_v3_recipe_counts_and_plan_terms():
    """The `deepseek-v3` recipe has DeepSeek-V3's published 671B parameters (37B active); the
    FLOPs count MLA's projections as the built attention holds them; the planner's block terms
    are the bytes a real forward saves (a middle stage: one dense and one MoE block, the
    rotary tables and, beyond `routed_bytes`, 36 bytes of router loads and the sigmoid
    router's fp32 per-token sum)."""
    from megapar.mesh import Mesh
    from megapar.models import build_model
    from megapar.models.flops import mla_widths
    from megapar.models.recipes import resolve_model
    from megapar.plan.params import model_params

    v3 = resolve_model("deepseek-v3")
    assert (model_params(v3), model_params(v3) - v3.idle_expert_params) == (
        671_026_404_352, 37_552_282_624)
    s, b, h = 32, 3, 64
    for q_rank in (24, None):
        config = DeepseekV3Config(
            vocab_size=300, hidden_size=h, intermediate_size=160, moe_intermediate_size=40,
            num_hidden_layers=2, num_attention_heads=4, q_lora_rank=q_rank, kv_lora_rank=20,
            qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, max_position_embeddings=s,
            num_local_experts=4, n_group=2, topk_group=1, num_experts_per_tok=2,
            first_k_dense_replace=1)
        model = build_model(config, Mesh(Layout()), range(2), False, False)
        attn = model.layers["0"].attn
        assert mla_widths(config) == sum(p.numel() for n, p in attn.named_parameters()
                                         if "norm" not in n)
        held, planned = _held_and_planned(config, Mesh(Layout()), s, b)
        assert held == planned, q_rank


def _held_and_planned(config, mesh, s, b, comm="auto"):
    """(bytes a middle stage of `config` (one dense and one MoE block) keeps for backward on
    this rank's s tokens, fp32, and the planner's count of them: the blocks' terms, the rotary
    tables, the output and, beyond `routed_bytes`, 36 bytes of router loads and the sigmoid
    router's fp32 per-token sum). `comm`: --cp-comm-type, whose attention decides the MLA
    terms (`memory._mla_terms`)."""
    from megapar.models import build_model, set_cp_comm
    from megapar.plan import memory as mem
    from megapar.plan.context_parallel import cp_method
    from megapar.plan.experts import routed_bytes

    h = config.hidden_size
    model = build_model(config, mesh, range(2), False, False)
    model.init_weights(0)
    set_cp_comm(model, comm)
    if mesh.cp > 1:
        assert {layer.attn.context_parallel.method for layer in model.layers.values()} == {
            {"p2p": "ring", "all_gather": "all-gather", "a2a": "a2a"}[comm]}
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    saved = {}

    def pack(t):
        if t.untyped_storage()._cdata not in params:
            saved[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(torch.randn(b, s, h, requires_grad=True), {})
    held = sum(saved.values()) + out.untyped_storage().nbytes()
    method = cp_method(config, comm) if mesh.cp > 1 else None
    dense, moe = (mem.layer_bytes(s, b, h, 4, act_bytes=4, dropout=False, fused_attention=True,
                                  norm_stats=True, terms=mem.block_terms(config, m, method))
                  for m in (False, True))
    moe += routed_bytes(config, s * b, 4) + 36 + s * b * 4
    return held, dense + moe + s * b * h * 4 + 2 * s * config.rope_dim * 4


def _held_at_cp2():
    import torch.distributed as dist

    from megapar.mesh import Mesh

    config = DeepseekV3Config(
        vocab_size=300, hidden_size=64, intermediate_size=160, moe_intermediate_size=40,
        num_hidden_layers=2, num_attention_heads=4, q_lora_rank=24, kv_lora_rank=20,
        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, max_position_embeddings=32,
        num_local_experts=4, n_group=2, topk_group=1, num_experts_per_tok=2,
        first_k_dense_replace=1)
    mesh = Mesh(Layout(cp=2), dist.get_rank())
    return {comm: _held_and_planned(config, mesh, 32 // 2, 3, comm)
            for comm in ("p2p", "all_gather", "a2a")}


def test_the_plan_terms_hold_under_cp():
    """At cp 2 (each rank's 16 of 32 tokens, by the ring, the all-gather and the all-to-all)
    a middle stage keeps what the planner counts for its tokens: the all-to-all's kernel
    keeps what SDPA keeps at cp 1 (q, k, the value zero-padded to the qk head size, the output
    and its log-sum-exp; the output projection's input, the output cut back, apart), the ring
    and the all-gather q and k at the qk head size, v and the output at v's (the output
    projection's input a view of it) and the log-sum-exp: per head and token 2 x 16 + 2 x 12
    = 56 elements against 4 x 16 + 12 = 76."""
    from megapar.launcher import run_local

    for out in run_local(_held_at_cp2, 2):
        for comm, (held, planned) in out.items():
            assert held == planned, comm


def _held_at_tp2():
    """Per (q_lora_rank, --sp-regather): what a stage of two dense MLA blocks (of a model whose
    third is MoE) keeps for backward on a tp 2 rank under sequence parallelism (fp32, s 32,
    b 3: its 16 tokens' slice of each sequence), and the planner's count of it (the blocks' terms, the rotary tables of
    the whole sequence and the stage's output slice)."""
    import torch.distributed as dist

    from megapar.mesh import Mesh
    from megapar.models import build_model, set_sp_regather
    from megapar.plan import memory as mem

    s, b, h, t = 32, 3, 64, 2
    out = {}
    for q_rank, regather in ((24, False), (24, True), (None, False), (None, True)):
        config = DeepseekV3Config(
            vocab_size=300, hidden_size=h, intermediate_size=160, num_hidden_layers=3,
            num_attention_heads=4, q_lora_rank=q_rank, kv_lora_rank=20, qk_nope_head_dim=8,
            qk_rope_head_dim=8, v_head_dim=12, max_position_embeddings=s, num_local_experts=4,
            num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=2)
        mesh = Mesh(Layout(tp=t), dist.get_rank(), sequence_parallel=True)
        model = build_model(config, mesh, range(2), False, False)
        model.init_weights(0)
        set_sp_regather(model, regather)
        params = {p.untyped_storage()._cdata for p in model.parameters()}
        saved = {}

        def pack(x, params=params, saved=saved):
            if x.untyped_storage()._cdata not in params:
                saved[x.untyped_storage()._cdata] = x.untyped_storage().nbytes()
            return x

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            y = model(torch.randn(b, s // t, h, requires_grad=True), {})
        held = sum(saved.values()) + y.untyped_storage().nbytes()
        block = mem.layer_bytes(s, b, h, 4, t, True, act_bytes=4, dropout=False,
                                fused_attention=True, norm_stats=True,
                                terms=mem.block_terms(config, False), regather=regather)
        out[q_rank, regather] = held, 2 * block + s * b * h * 4 / t + 2 * s * config.rope_dim * 4
    return out


def test_the_plan_terms_hold_at_tp2_with_sequence_parallelism():
    """At tp 2 under SP two dense MLA blocks keep what the planner counts: without
    --sp-regather the latents (24 + 20 + 8 = 52 a token) whole, as they were gathered; with it
    this rank's slice of them (q_b and kv_b save it once between them and re-gather it in the
    backward), as the planner's split count: 9,984 bytes a layer less, with the MLP input's
    12,288 (a plain q projection too: its input's slice is the attention norm's output, which
    kv_a keeps anyway). Without the flag a plain q projection keeps its gathered input and
    kv_a this rank's slice of it: the plan had counted the former only (12,288 bytes a layer
    short)."""
    from megapar.launcher import run_local

    for out in run_local(_held_at_tp2, 2):
        for key, (held, planned) in out.items():
            assert held == planned, (key, held, planned)
        assert out[24, False][0] - out[24, True][0] == 2 * 3 * (32 - 16) * (52 + 64) * 4
