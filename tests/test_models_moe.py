"""Mixtral and Qwen3-MoE built from megapar's MoE layer equal transformers' MixtralForCausalLM and
Qwen3MoeForCausalLM: logits, the loss with the load-balancing loss, and every gradient (fp32).

Seeded tiny transformers models (GQA, 4 experts, top 2; Qwen3-MoE with a dense layer via
mlp_only_layers, without top-k renormalisation) are saved with save_pretrained (per-expert
tensors on disk) and imported. transformers' aux loss (`load_balancing_loss_func`) over all layers
at once is a cross-layer product; megapar's is that function per MoE layer, averaged over the
layers (the same for one MoE layer), so the reference is built from transformers' router logits
with the same function per layer. Also: the MoE layer's pieces against plain references (the
per-expert loop against per-token routing, the capacity factor's drops, the auxiliary-loss-free
bias moving toward balance) and the HF export round trip.
"""

import pytest
import torch
import transformers
from canonical import gather_canonical
from tp_utils import assert_close, make_mesh
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

from megapar.checkpoint.hf import HFReader, load_hf_weights, save_hf
from megapar.checkpoint.hf_names import llama_canonical
from megapar.mesh import Layout
from megapar.models import Llama, MixtralConfig, Qwen3MoeConfig
from megapar.models.config import ConfigError
from megapar.models.moe import GroupedExperts, MoE, moe_layers, route

VOCAB, SEQ, B = 101, 12, 3
BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            num_experts_per_tok=2, router_aux_loss_coef=0.02, output_router_logits=True)
KINDS = {
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                dict(num_local_experts=4)),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(num_experts=4, moe_intermediate_size=24, head_dim=8, norm_topk_prob=False,
                       mlp_only_layers=[1])),
}


def hf_dir(root, kind: str, layers: int = 3) -> str:
    config_cls, model_cls, extra = KINDS[kind]
    torch.manual_seed(0)
    model = model_cls(config_cls(**dict(BASE, num_hidden_layers=layers), **extra))
    with torch.no_grad():  # non-trivial norms and router, so a mapping mistake shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            if name.endswith("gate.weight"):
                p.normal_(0, 0.5)
    path = root / f"{kind}-{layers}"
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_moe")
    return {kind: hf_dir(root, kind) for kind in KINDS}


def batch():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (B, SEQ), generator=gen)
    labels = torch.cat([ids[:, 1:], torch.full((B, 1), -100)], dim=1)  # HF shifts inside
    return ids, labels


def hf_reference(path, kind):
    model_cls = KINDS[kind][1]
    hf = model_cls.from_pretrained(path, attn_implementation="eager").train()
    ids, _ = batch()
    out = hf(input_ids=ids, labels=ids, output_router_logits=True)
    e, k = hf.config.num_local_experts, hf.config.num_experts_per_tok
    per_layer = [load_balancing_loss_func((g,), e, k) for g in out.router_logits]
    aux = torch.stack(per_layer).mean()
    ce = out.loss - hf.config.router_aux_loss_coef * out.aux_loss
    (ce + hf.config.router_aux_loss_coef * aux).backward()
    grads = {}
    for name, p in hf.named_parameters():
        name = name.removeprefix("model.")
        if kind == "mixtral":  # transformers 5 names Mixtral's block `mlp` in memory only
            name = name.replace(".mlp.", ".block_sparse_moe.")
        if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            block = name.rsplit(".experts.", 1)[0]
            names = {"mixtral": ("w1", "w3", "w2"),
                     "qwen3_moe": ("gate_proj", "up_proj", "down_proj")}[kind]
            for ex in range(e):
                if name.endswith("gate_up_proj"):
                    gate, up = p.grad[ex].chunk(2)
                    grads[f"{block}.experts.{ex}.{names[0]}.weight"] = gate
                    grads[f"{block}.experts.{ex}.{names[1]}.weight"] = up
                else:
                    grads[f"{block}.experts.{ex}.{names[2]}.weight"] = p.grad[ex]
        else:
            grads[name] = p.grad
    config = HFReader(path).config
    return out.logits.detach(), ce.detach(), aux.detach(), lambda n: llama_canonical(
        n, grads.__getitem__, config)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_moe_model_equals_transformers(hf_dirs, kind):
    path = hf_dirs[kind]
    reader = HFReader(path)
    config = reader.config
    assert config.model_type == kind
    model = Llama(config, make_mesh(1))
    assert load_hf_weights(model, reader) == []
    # megapar.prepare's reader of a model in memory (transformers 5: Mixtral's block `mlp`,
    # its experts fused) reads the same weights as the files
    in_memory = HFReader.from_model(KINDS[kind][1].from_pretrained(path))
    for name, _ in model.named_parameters():
        assert torch.equal(in_memory.canonical(name), reader.canonical(name)), name
    ref_logits, ref_ce, ref_aux, ref_grad = hf_reference(path, kind)
    ids, labels = batch()
    with torch.no_grad():
        assert_close(model(None, {"input_ids": ids})[..., :VOCAB], ref_logits, what="logits")
    model.train()
    loss = model(None, {"input_ids": ids, "labels": labels})
    layers = moe_layers(model)
    assert len(layers) == config.num_moe_layers == (2 if kind == "qwen3_moe" else 3)
    aux = torch.stack([m.last["switch"] for m in layers]).mean()
    assert_close(loss, ref_ce, what="loss")
    assert_close(aux, ref_aux, what="aux loss")
    loss.backward()  # the penalty joins through the layers' outputs (gradient 1.0)
    names = [n for n, _ in model.named_parameters()]
    assert any("experts.gate_up" in n for n in names) and any("router" in n for n in names)
    for name, p in model.named_parameters():
        grad = p.grad[tuple(slice(0, n) for n in p.full_shape)]  # the vocabulary unpadded
        assert_close(grad, ref_grad(name), what=f"grad of {name}")


def test_one_moe_layer_loss_equals_transformers_model_loss(tmp_path):
    """With one MoE layer transformers' cross-layer aux loss is the per-layer one: its model's
    loss (cross-entropy + coef x aux) equals megapar's."""
    path = hf_dir(tmp_path, "mixtral", layers=1)
    hf = transformers.MixtralForCausalLM.from_pretrained(path).train()
    ids, labels = batch()
    ref = hf(input_ids=ids, labels=ids, output_router_logits=True).loss
    reader = HFReader(path)
    model = Llama(reader.config, make_mesh(1))
    load_hf_weights(model, reader)
    model.train()
    ce = model(None, {"input_ids": ids, "labels": labels})
    total = ce + reader.config.router_aux_loss_coef * moe_layers(model)[0].last["switch"]
    assert_close(total, ref.detach(), what="loss with aux")


def test_hf_export_round_trips_with_transformers(hf_dirs, tmp_path):
    for kind, path in hf_dirs.items():
        reader = HFReader(path)
        model = Llama(reader.config, make_mesh(1))
        load_hf_weights(model, reader)
        out = tmp_path / kind
        save_hf(gather_canonical(model), reader.config, out)
        model_cls = KINDS[kind][1]
        a = model_cls.from_pretrained(path).state_dict()
        b = model_cls.from_pretrained(str(out)).state_dict()
        assert a.keys() == b.keys()
        for key, tensor in a.items():
            assert torch.equal(b[key], tensor), key


def _per_token_reference(x, gate_up, down, experts, weights):
    """Each token through its k experts one at a time: the definition."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(experts.shape[1]):
            e = experts[t, j]
            g, u = (gate_up[e] @ x[t]).chunk(2)
            out[t] += weights[t, j] * (down[e] @ (torch.nn.functional.silu(g) * u))
    return out


def test_grouped_experts_equal_per_token_routing_and_capacity_drops():
    torch.manual_seed(0)
    t, h, size, e, k = 10, 8, 6, 4, 2
    experts = GroupedExperts(e, h, size, "silu", "cpu")
    torch.nn.init.normal_(experts.gate_up)
    torch.nn.init.normal_(experts.down)
    x = torch.randn(t, h)
    choice = torch.tensor([[0, 1]] * 7 + [[2, 3]] * 3)  # expert 0 and 1 get 7 tokens each
    weights = torch.rand(t, k)
    order, tokens, dropped = route(choice, e, None)
    assert tokens.tolist() == [7, 7, 3, 3] and int(dropped) == 0
    y = experts(x[order // k], tokens) * weights.reshape(-1)[order, None]
    got = torch.zeros(t * k, h).index_copy(0, order, y).view(t, k, h).sum(1)
    assert_close(got, _per_token_reference(x, experts.gate_up, experts.down, choice, weights))
    # capacity ceil(1.0 * 10 * 2 / 4) = 5: experts 0 and 1 keep their first 5 tokens
    order, tokens, dropped = route(choice, e, 5)
    assert tokens.tolist() == [5, 5, 3, 3] and int(dropped) == 4
    y = experts(x[order // k], tokens) * weights.reshape(-1)[order, None]
    got = torch.zeros(t * k, h).index_copy(0, order, y).view(t, k, h).sum(1)
    kept = weights.clone()
    kept[5:7] = 0  # tokens 5 and 6 lost both their experts
    assert_close(got, _per_token_reference(x, experts.gate_up, experts.down, choice, kept))
    # no row at all (an ep rank that receives none): the output stays in the graph of its input
    # and the weights, so the backward's all-to-alls and gradient reductions still run there
    empty = x[:0].clone().requires_grad_()
    y = experts(empty, torch.zeros(e, dtype=torch.long), [0] * e)
    assert y.shape == (0, h) and y.grad_fn is not None
    y.sum().backward()
    assert empty.grad is not None and experts.gate_up.grad is not None
    assert not experts.gate_up.grad.any() and not experts.down.grad.any()


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="torch without _grouped_mm")
def test_grouped_mm_path_equals_the_expert_loop_with_capacity_drops():
    """The CUDA path (`torch._grouped_mm`, which torch >= 2.9 also runs on the CPU) equals the
    loop over experts: outputs and every gradient, with a capacity's dropped rows after the
    groups (the kernel leaves those rows of its output and of its input's gradient unwritten:
    uninitialised memory, so several draws)."""
    t, h, size, e, k = 24, 16, 8, 4, 2
    for seed in range(6):
        torch.manual_seed(seed)
        experts = GroupedExperts(e, h, size, "silu", "cpu")
        torch.nn.init.normal_(experts.gate_up)
        torch.nn.init.normal_(experts.down)
        order, tokens, dropped = route(torch.randint(0, e, (t, k)), e, 4)
        assert int(dropped) > 0 and int(tokens.sum()) < t * k
        x = torch.randn(t, h)
        grad = torch.randn(t * k, h)
        got = []
        for run in (experts._grouped, experts):
            rows = x.clone().requires_grad_()
            experts.zero_grad(set_to_none=True)
            y = run(rows[order // k], tokens)
            y.backward(grad)
            got.append((y, rows.grad, experts.gate_up.grad, experts.down.grad))
        for a, b, what in zip(*got, ("output", "input grad", "gate_up grad", "down grad")):
            assert_close(a, b, what=f"seed {seed} {what}")


def _skewed_moe(rate):
    config = MixtralConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=8,
                           num_hidden_layers=1, num_attention_heads=2, num_local_experts=4,
                           num_experts_per_tok=1, moe_bias_update_rate=rate)
    layer = MoE(config, make_mesh(1))
    torch.manual_seed(0)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1)
    with torch.no_grad():
        layer.router.weight[0] += 0.5  # expert 0 is everyone's favourite
    return layer.train()


def test_aux_free_bias_moves_the_load_toward_balance():
    layer = _skewed_moe(0.05)
    x = torch.randn(1, 64, 16).abs()

    def load():
        layer.stats.reset()
        layer(x)
        return layer.stats.values[:4].clone()

    first = load()
    for _ in range(40):
        layer.router.update_bias(load(), 0.05)
    last = load()
    assert first.max() / first.mean() > 2.5, first
    assert last.max() / last.mean() < first.max() / first.mean() - 1, (first, last)


def test_qwen3_moe_config_reads_the_hub_spelling_and_round_trips():
    d = dict(BASE, model_type="qwen3_moe", num_experts=8, moe_intermediate_size=16,
             decoder_sparse_step=2, mlp_only_layers=None)
    config = Qwen3MoeConfig.from_dict(d)
    assert config.num_local_experts == 8 and config.num_moe_layers == 1
    assert [config.is_moe_layer(i) for i in range(3)] == [False, True, False]
    hf = config.to_hf()
    assert hf.architectures == ["Qwen3MoeForCausalLM"] and hf.num_experts == 8
    assert Qwen3MoeConfig.from_dict(config.to_dict()) == config
    # refusals name the key the config.json has (the hub's num_experts, transformers 5's
    # num_local_experts: a tryout's file had only the latter) and what is wrong
    layout = Layout()
    with pytest.raises(ConfigError, match=r"^num_experts_per_tok 9 exceeds the 8 routed experts "
                       r"\(num_experts, or num_local_experts as transformers 5 writes it\); "
                       r"route each token to at most 8$"):
        Qwen3MoeConfig.from_dict(dict(d, num_experts_per_tok=9)).validate(layout)
    with pytest.raises(ConfigError, match=r"\(num_local_experts\)"):
        MixtralConfig.from_dict(dict(BASE, num_local_experts=1)).validate(layout)
    with pytest.raises(ConfigError, match=r"^the config has no MoE layer \(of its 3 layers, "
                       r"mlp_only_layers \[1\] and decoder_sparse_step 2 leave none sparse\); "
                       r"use a llama config instead$"):
        Qwen3MoeConfig.from_dict(dict(d, mlp_only_layers=[1])).validate(layout)


@pytest.mark.parametrize("name, params", [
    ("mixtral-8x7b", 46_702_792_704),   # mistralai/Mixtral-8x7B-v0.1
    ("qwen3-30b-a3b", 30_532_122_624),  # Qwen/Qwen3-30B-A3B
])
def test_moe_recipes_have_the_published_parameter_counts(name, params):
    import math

    from megapar.mesh import Layout, Mesh
    from megapar.models.recipes import resolve_model
    from megapar.pipeline.partition import build_stage

    config = resolve_model(name)
    model = build_stage(config, Mesh.virtual(Layout()), 0, init=False)
    assert sum(math.prod(p.full_shape) for p in model.parameters()) == params
    config.validate(Layout(tp=4, pp=4))


def test_sigmoid_router_weighs_by_unbiased_scores_renormalised():
    """DeepSeek-V3's router: sigmoid scores, the bias chooses but never weighs."""
    config = MixtralConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=8,
                           num_hidden_layers=1, num_attention_heads=2, num_local_experts=4,
                           moe_router_score="sigmoid", moe_bias_update_rate=0.1)
    layer = MoE(config, make_mesh(1))
    torch.nn.init.normal_(layer.router.weight)
    layer.router.bias = torch.tensor([0.0, 0.0, 0.0, 10.0])  # expert 3 is always chosen
    x = torch.randn(5, 16)
    _, probs, weights, experts = layer.router(x)
    scores = torch.sigmoid(x @ layer.router.weight.T)
    assert (experts == 3).any(dim=1).all()
    chosen = scores.gather(1, experts)
    assert_close(weights, chosen / chosen.sum(1, keepdim=True))
    assert_close(probs.sum(1), torch.ones(5))


def test_padding_does_not_widen_the_capacity(hf_dirs):
    """With a capacity factor, a right-padded row's tokens route as the same tokens unpadded:
    the capacity is ceil(factor x T x k / E) of the T tokens that are not padding, not of every
    row (which let a padded batch keep assignments its tokens alone would drop). The same
    logits on the real tokens and the same dropped assignments in each MoE layer (some)."""
    reader = HFReader(hf_dirs["mixtral"])
    reader.config.moe_capacity_factor = 1.0
    model = Llama(reader.config, make_mesh(1)).train()
    load_hf_weights(model, reader)
    ids, _ = batch()
    real = 7
    mask = (torch.arange(SEQ)[None] < real).long().expand(B, SEQ)
    padded = torch.where(mask.bool(), ids, 0)
    runs = {}
    for name, inputs in (("padded", {"input_ids": padded, "attention_mask": mask}),
                         ("alone", {"input_ids": ids[:, :real]})):
        for layer in moe_layers(model):
            layer.stats.reset()
        logits = model(None, inputs)[:, :real]
        dropped = [layer.stats.values[-2].item() for layer in moe_layers(model)]
        runs[name] = logits.detach(), dropped
    assert runs["padded"][1] == runs["alone"][1] and sum(runs["alone"][1]) > 0, runs
    assert_close(runs["padded"][0], runs["alone"][0], what="the real tokens' logits")


def test_one_host_sync_per_moe_layer_per_micro_batch(hf_dirs):
    """The expert loop reads the tokens per expert to the host once per MoE layer (the only
    sync of a micro-batch's forward and backward); routing, capacity and combine make none."""
    from sync_count import count_syncs

    reader = HFReader(hf_dirs["mixtral"])
    reader.config.moe_capacity_factor = 1.0
    model = Llama(reader.config, make_mesh(1))
    load_hf_weights(model, reader)
    ids, labels = batch()
    with count_syncs() as syncs:
        model.train()(None, {"input_ids": ids, "labels": labels}).backward()
    assert sum(syncs.values()) == 3, syncs  # 3 MoE layers
    assert all(call == "tolist" and where.startswith("models/moe.py") for call, where in syncs)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_padding_is_left_out_of_the_balancing_terms_as_transformers_attention_mask(kind):
    """Right-padded samples (`--sft-keys`' layout) with their attention_mask: each MoE layer's
    switch loss equals transformers' `load_balancing_loss_func` given the attention_mask, and
    its z-loss the mean of logsumexp(logits)^2 over the tokens that are not padding; the
    router statistics count no padding (padding used to be routed and counted in all three)."""
    config_cls, model_cls, extra = KINDS[kind]
    torch.manual_seed(0)
    hf = model_cls(config_cls(**BASE, **extra)).train()
    with torch.no_grad():  # a router far from uniform, so padding's share shows
        for name, p in hf.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0, 0.5)
    ids, _ = batch()
    mask = (torch.arange(SEQ)[None] < torch.tensor([[SEQ], [7], [3]])).long()
    out = hf(input_ids=ids, attention_mask=mask, output_router_logits=True)
    reader = HFReader.from_model(hf)
    model = Llama(reader.config, make_mesh(1)).train()
    assert load_hf_weights(model, reader) == []
    with torch.no_grad():  # no statistics yet
        model(None, {"input_ids": ids, "attention_mask": mask})
    layers = moe_layers(model)
    assert len(layers) == len(out.router_logits) >= 2
    e, k = hf.config.num_local_experts, hf.config.num_experts_per_tok
    for layer, g in zip(layers, out.router_logits):
        switch = load_balancing_loss_func((g,), e, k, attention_mask=mask)
        assert not torch.allclose(switch, load_balancing_loss_func((g,), e, k), rtol=1e-3)
        assert_close(layer.last["switch"], switch.detach(), what="switch loss")
        lse = torch.logsumexp(g.float(), dim=-1).square()
        z = (lse * mask.reshape(-1)).sum() / mask.sum()
        assert_close(layer.last["z"], z.detach(), what="z-loss")
    model(None, {"input_ids": ids, "attention_mask": mask, "labels": ids}).backward()
    for layer in layers:  # the kept assignments: k per token that is not padding
        assert layer.stats.values[:e].sum().item() == k * mask.sum().item()
