"""Megatron-core torch_dist checkpoints: megapar-convert --from-megatron of the checkpoints
megatron-core 0.16.1 itself wrote (tests/fixtures/megatron: GPT-2-, Llama- and Mixtral-like GPTs;
its README says how) gives logits equal to Megatron's own forward (fp32, 1e-5 relative), the
model from --model or from the args common.pt records (read without unpickling: a pickle that
would run code runs none), from Megatron's saves at tp 1, tp 2, pp 2 and tp 2 x pp 2 (each
reading as the tp 1 save bit for bit), and after megapar's own tp 2 x pp 2; Megatron's mixtures
of experts as megapar's Mixtral (Megatron's softmax and sigmoid routers, the expert bias, a shared
expert, saved at ep 2; megapar's forward at tp 1, tp 2 and dp 2 x ep 2 equal to Megatron's), a
routing megapar does not compute refused naming Megatron's option; Transformer Engine's and the older
local spec's norm names read alike; what megapar cannot read (the legacy pickle format, another
backend, an architecture it lacks, no model given or recorded) is refused in one line; --load of
a Megatron directory names the import."""

import argparse
import json
import os
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dist_cp
from safetensors.torch import load_file

import megapar
from megapar.checkpoint.convert import plan
from megapar.checkpoint.distributed import load_checkpoint
from megapar.checkpoint.format import ShardReader
from megapar.checkpoint.manifest import verify
from megapar.checkpoint.megatron import MegatronReader
from megapar.checkpoint.publish import foreign_checkpoint, resolve_checkpoint
from megapar.cli.convert import main as convert
from megapar.mesh import Layout, Mesh
from megapar.models.config import config_from_dict
from megapar.pipeline.partition import build_stage

FIXTURES = Path(__file__).parent / "fixtures" / "megatron"
SPECS = {
    "gpt": {"model_type": "gpt2", "vocab_size": 64, "n_positions": 16, "n_embd": 8,
            "n_layer": 2, "n_head": 2, "n_inner": 32, "activation_function": "gelu",
            "layer_norm_epsilon": 1e-5, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
            "attn_pdrop": 0.0},
    "llama": {"model_type": "llama", "vocab_size": 64, "hidden_size": 16,
              "intermediate_size": 24, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "max_position_embeddings": 16},
}
SPECS["moe"] = {**SPECS["llama"], "model_type": "mixtral", "intermediate_size": 12,
                "num_local_experts": 4, "num_experts_per_tok": 2, "router_aux_loss_coef": 0.02}
SPECS["moe_sig"] = {**SPECS["moe"], "moe_router_score": "sigmoid", "moe_bias_update_rate": 1e-3,
                    "shared_expert_intermediate_size": 20}
"""The models make_fixture.py built, in megapar's (transformers') field names (the MoE ones'
aux-loss coefficient: Megatron's 0.01 per layer, megapar's of the mean over 2 layers)."""

pytestmark = pytest.mark.skipif(
    not (FIXTURES / "expected_logits.safetensors").is_file(),
    reason="tests/fixtures/megatron (Megatron-written checkpoints) is not in this checkout",
)


def spec_file(tmp_path, kind: str, **changes) -> str:
    path = tmp_path / f"{kind}.json"
    path.write_text(json.dumps({**SPECS[kind], **changes}))
    return str(path)


def megapar_logits(ckpt, ids: torch.Tensor, edit=None) -> torch.Tensor:
    """The logits of checkpoint `ckpt`'s model in one process (megapar's own stage model;
    `edit(model)` changes it after the load)."""
    step = resolve_checkpoint(ckpt)
    manifest = verify(step)
    model = build_stage(config_from_dict(manifest["model"]), Mesh(Layout()), 0).eval()
    reader = ShardReader(step, manifest)
    params = dict(model.named_parameters())
    buffers = {n for n, e in manifest["tensors"].items() if e.get("buffer")}
    assert set(params) | buffers == set(manifest["tensors"])
    params |= {n: b for n, b in model.named_buffers() if n in buffers}  # a router's bias
    with torch.no_grad():
        for name, e in manifest["tensors"].items():
            dim = e["tp_dim"]
            full = reader.shard(name, None, 1, 0, None if dim is None else e["full_shape"][dim])
            params[name][: full.shape[0]].copy_(full)  # rows past the vocabulary: padding
        if edit is not None:
            edit(model)
        logits = model(None, {"input_ids": ids})
    reader.release()
    return logits[0, :, : manifest["model"]["vocab_size"]]


@pytest.mark.parametrize("given", [True, False], ids=["--model", "args"])
@pytest.mark.parametrize("kind, saved", [("gpt", "gpt"), ("llama", "llama"),
                                         ("llama", "llama_tp2"), ("llama", "llama_pp2"),
                                         ("gpt", "gpt_tp2pp2"), ("moe", "moe"),
                                         ("moe_sig", "moe_sig_ep2")])
def test_logits_equal_megatrons_forward(tmp_path, kind, saved, given, capsys):
    """llama_tp2 is llama re-saved by Megatron at tp 2 (its tp 2 forward gave the same logits):
    every layer tensor in two tp chunks, the query groups and SwiGLU's halves split;
    llama_pp2 at pp 2 (one layer per stage, each stage's file holding its layer's rows of the
    stacked tensors) and gpt_tp2pp2 at tp 2 x pp 2 (the tied head's copy on the last stage).
    moe is a Mixtral (softmax of the top 2 of 4 experts' logits); moe_sig routes by sigmoid
    scores with an expert bias that changes the routing, has a shared expert and was built,
    run and saved by Megatron at expert-parallel size 2 (two experts in each rank's files)."""
    expected = load_file(FIXTURES / "expected_logits.safetensors")
    model = ["--model", spec_file(tmp_path, kind)] if given else []
    assert convert(["--from-megatron", str(FIXTURES / saved), str(tmp_path / "ck"), *model,
                    "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "iter_0000007 iteration 7" in out and "weights only" in out
    assert ("the model is the training args iter_0000007/common.pt records" in out) != given
    if not given:  # the args' model is the one make_fixture.py built
        manifest = verify(resolve_checkpoint(tmp_path / "ck"))
        assert {k: manifest["model"][k] for k in SPECS[kind]} == SPECS[kind]
    want = expected[f"{kind}_logits"]
    got = megapar_logits(tmp_path / "ck", expected["ids"])
    assert got.shape == want.shape == (12, 64)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (got - want).abs().max()


def _sharded_logits(step: str, ids: torch.Tensor) -> list[torch.Tensor]:
    """On each of 2 forked ranks: the logits of checkpoint `step`'s model loaded by megapar's
    own load at tp 2 (gathered over the vocabulary) and at dp 2 x ep 2 (two experts a rank,
    the tokens exchanged), in that order."""
    config = config_from_dict(verify(Path(step))["model"])
    out = []
    for layout in (Layout(tp=2), Layout(dp=2, ep=2)):
        mesh = Mesh(layout, dist.get_rank())
        model = build_stage(config, mesh, 0).eval()
        load_checkpoint(Path(step), model, mesh)
        with torch.no_grad():
            logits = model(None, {"input_ids": ids})
        if layout.tp > 1:
            parts = [torch.empty_like(logits) for _ in range(layout.tp)]
            dist.all_gather(parts, logits.contiguous(), group=mesh.tp_group)
            logits = torch.cat(parts, -1)
        out.append(logits[0, :, : config.vocab_size])
    return out


def test_megapar_at_tp_2_and_ep_2_gives_megatrons_logits(tmp_path):
    """moe_sig imported, loaded by megapar at tp 2 (the shared expert split) and at dp 2 x ep 2
    (the experts over two ranks, as Megatron held them when it saved): Megatron's logits."""
    expected = load_file(FIXTURES / "expected_logits.safetensors")
    assert convert(["--from-megatron", str(FIXTURES / "moe_sig_ep2"), str(tmp_path / "ck"),
                    "--no-progress"]) == 0
    step = resolve_checkpoint(tmp_path / "ck")
    want = expected["moe_sig_logits"]
    tp2, ep2 = megapar.launch(_sharded_logits, 2, str(step), expected["ids"])  # rank 0's
    for got in (tp2, ep2):
        assert got.shape == want.shape == (12, 64)
        assert (got - want).abs().max() <= 1e-5 * want.abs().max(), (got - want).abs().max()


def test_the_expert_bias_decides_the_routing(tmp_path):
    """moe_sig's expert bias changes which experts its tokens take: with the imported bias
    zeroed, megapar's logits are far from Megatron's (so the test above checks its mapping)."""
    expected = load_file(FIXTURES / "expected_logits.safetensors")
    assert convert(["--from-megatron", str(FIXTURES / "moe_sig_ep2"), str(tmp_path / "ck"),
                    "--no-progress"]) == 0

    def zero_bias(model):
        for name, buffer in model.named_buffers():
            if name.endswith("router.bias"):
                buffer.zero_()

    want = expected["moe_sig_logits"]
    got = megapar_logits(tmp_path / "ck", expected["ids"], edit=zero_bias)
    assert (got - want).abs().max() > 1e-2 * want.abs().max()


@pytest.mark.parametrize("kind, saved", [("llama", "llama_tp2"), ("llama", "llama_pp2"),
                                         ("gpt", "gpt_tp2pp2")])
def test_a_megatron_save_in_another_layout_reads_as_the_tp_1_save(kind, saved):
    """Megatron re-saved the tp 1 checkpoint at tp 2, pp 2, tp 2 x pp 2: every canonical
    tensor read from that save equals the tp 1 save's bit for bit."""
    one, other = MegatronReader(FIXTURES / kind, None), MegatronReader(FIXTURES / saved, None)
    assert other.config.to_dict() == one.config.to_dict()
    names = list(plan(one.config, Layout()))
    assert len(names) > 10
    for name in names:
        assert torch.equal(one.canonical(name), other.canonical(name)), name


@pytest.mark.parametrize("kind, saved", [("llama", "llama"), ("moe_sig", "moe_sig_ep2")])
def test_another_layout_holds_the_same_weights(tmp_path, kind, saved):
    """megapar's import at tp 2 x pp 2 (moe_sig: the shared expert split over tp, the routed
    experts split along the experts over the tp files, router and bias whole) read back at tp 1
    is the tp 1 import, bit for bit."""
    spec = spec_file(tmp_path, kind)
    src = str(FIXTURES / saved / "iter_0000007")
    assert convert(["--from-megatron", src, str(tmp_path / "a"), "--model", spec,
                    "--no-progress"]) == 0
    assert convert(["--from-megatron", src, str(tmp_path / "b"), "--model", spec,
                    "--tp", "2", "--pp", "2", "--no-progress"]) == 0
    assert convert([str(tmp_path / "b"), str(tmp_path / "c"), "--tp", "1", "--pp", "1",
                    "--no-progress"]) == 0
    a, c = (resolve_checkpoint(tmp_path / d) for d in "ac")
    ra, rc = ShardReader(a, verify(a)), ShardReader(c, verify(c))
    for name, e in verify(a)["tensors"].items():
        full = None if e["tp_dim"] is None else e["full_shape"][e["tp_dim"]]
        assert torch.equal(ra.shard(name, None, 1, 0, full), rc.shard(name, None, 1, 0, full))


def megatron_llama_state(fused_norms: bool, extra: dict | None = None) -> dict:
    """A Llama-like GPT's tensors in Megatron's torch_dist names (layers stacked), random."""
    g = torch.Generator().manual_seed(0)
    c = SPECS["llama"]
    d, f, v, n = c["hidden_size"], c["intermediate_size"], c["vocab_size"], 2
    qkv = (c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * d // 4
    L = "decoder.layers."
    attn, mlp = (("self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight")
                 if fused_norms else ("input_layernorm.weight", "pre_mlp_layernorm.weight"))
    shapes = {"embedding.word_embeddings.weight": [v, d], "output_layer.weight": [v, d],
              "decoder.final_layernorm.weight": [d], L + attn: [n, d], L + mlp: [n, d],
              L + "self_attention.linear_qkv.weight": [n, qkv, d],
              L + "self_attention.linear_proj.weight": [n, d, d],
              L + "mlp.linear_fc1.weight": [n, 2 * f, d], L + "mlp.linear_fc2.weight": [n, d, f]}
    return {k: torch.randn(*s, generator=g) for k, s in shapes.items()} | (extra or {})


def save_megatron(state: dict, root: Path, backend: str = "torch_dist", common=None) -> Path:
    """`state` saved by torch's DCP as a Megatron root's iter_0000003 (with its metadata.json
    and tracker file); torch's own save, not Megatron's, for the names Megatron 0.16.1's local
    spec does not write."""
    it = root / "iter_0000003"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dist_cp.save(state, checkpoint_id=str(it), no_dist=True)
    (it / "metadata.json").write_text(json.dumps({"sharded_backend": backend,
                                                  "sharded_backend_version": 1}))
    (root / "latest_checkpointed_iteration.txt").write_text("3")
    if common is not None:  # written as Megatron writes it (torch.save), never loaded here
        torch.save(common, it / "common.pt")
    return root


@pytest.mark.parametrize("fused", [True, False])
def test_both_norm_spellings_and_the_query_groups(tmp_path, fused):
    state = megatron_llama_state(fused)
    reader = MegatronReader(save_megatron(state, tmp_path / "m"), spec_file(tmp_path, "llama"))
    norm = "self_attention.linear_qkv.layer_norm_weight" if fused else "input_layernorm.weight"
    assert torch.equal(reader.canonical("layers.1.attn_norm.weight"),
                       state["decoder.layers." + norm][1])
    qkv = state["decoder.layers.self_attention.linear_qkv.weight"][1].view(2, 4, 4, 16)
    # each of the 2 query groups: [2 query heads, its key head, its value head] x head_dim 4
    assert torch.equal(reader.canonical("layers.1.attn.q.weight"), qkv[:, :2].reshape(16, 16))
    assert torch.equal(reader.canonical("layers.1.attn.k.weight"), qkv[:, 2].reshape(8, 16))
    assert torch.equal(reader.canonical("layers.1.attn.v.weight"), qkv[:, 3].reshape(8, 16))
    fc1 = state["decoder.layers.mlp.linear_fc1.weight"][0]
    assert torch.equal(reader.canonical("layers.0.mlp.gate.weight"), fc1[:24])
    assert torch.equal(reader.canonical("layers.0.mlp.up.weight"), fc1[24:])
    assert not reader.config.tie_word_embeddings


def test_a_tied_head_and_optimizer_state(tmp_path, capsys):
    """No output_layer: the head is the embedding (Megatron's default, without
    --untie-embeddings-and-output-weights); optimizer state is named and left."""
    state = megatron_llama_state(True, {"optimizer.state.exp_avg.embedding.word_embeddings.weight":
                                        torch.zeros(64, 16)})
    del state["output_layer.weight"]
    assert convert(["--from-megatron", str(save_megatron(state, tmp_path / "m")),
                    str(tmp_path / "ck"), "--model", spec_file(tmp_path, "llama"),
                    "--no-progress"]) == 0
    assert "holds optimizer state too; it is not imported" in capsys.readouterr().out
    manifest = verify(resolve_checkpoint(tmp_path / "ck"))
    assert manifest["model"]["tie_word_embeddings"] and "head.weight" not in manifest["tensors"]


def refusal(capsys, *argv) -> str:
    assert convert(list(argv) + ["--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err


TRACKER_NAME = "latest_checkpointed_iteration.txt"


def test_what_cannot_be_read_is_refused_in_one_line(tmp_path, capsys):
    legacy = tmp_path / "legacy" / "iter_0000005" / "mp_rank_00"
    legacy.mkdir(parents=True)
    (legacy / "model_optim_rng.pt").write_bytes(b"not read")
    (tmp_path / "legacy" / "latest_checkpointed_iteration.txt").write_text("5")
    err = refusal(capsys, "--from-megatron", str(tmp_path / "legacy"), str(tmp_path / "o"),
                  "--model", spec_file(tmp_path, "gpt"))
    assert "legacy torch format" in err and "--ckpt-convert-format torch_dist" in err
    # its mp_rank_XX directory or its pickle: Megatron's --load takes the root (the fix named
    # the mp_rank_00 directory; the pickle was "no such directory")
    for given in (legacy, legacy / "model_optim_rng.pt", legacy.parent):
        err = refusal(capsys, "--from-megatron", str(given), str(tmp_path / "o"))
        assert "legacy torch format" in err, err
        assert f"--load {tmp_path / 'legacy'} --ckpt-convert-format torch_dist" in err, err
    err = refusal(capsys, "--from-megatron", str(tmp_path / "legacy" / TRACKER_NAME),
                  str(tmp_path / "o"))
    assert err.strip() == (
        f"megapar-convert: error: --from-megatron {tmp_path / 'legacy' / TRACKER_NAME} is a "
        f"file; give a Megatron-LM checkpoint root (with {TRACKER_NAME}) or one iter_NNNNNNN "
        f"directory"), err
    err = refusal(capsys, "--from-megatron", str(save_megatron(megatron_llama_state(True),
                                                               tmp_path / "bare")),
                  str(tmp_path / "o"))
    assert "common.pt records no training args; say which model this is with --model" in err
    err = refusal(capsys, "--from-megatron", str(FIXTURES / "gpt"), str(tmp_path / "o"),
                  "--model", spec_file(tmp_path, "llama"))
    assert "give a gpt2 config" in err
    err = refusal(capsys, "--from-megatron", str(FIXTURES / "llama"), str(tmp_path / "o"),
                  "--model", spec_file(tmp_path, "llama", num_key_value_heads=4))
    assert "linear_qkv.weight is [2, 32, 16], --model implies [2, 48, 16]" in err
    err = refusal(capsys, "--from-megatron", str(FIXTURES / "moe"), str(tmp_path / "o"),
                  "--model", spec_file(tmp_path, "llama"))
    assert "holds a mixtral-like GPT (RoPE, SwiGLU experts): give a mixtral config" in err
    odd = megatron_llama_state(True, {"decoder.layers.mlp.linear_fc3.weight": torch.zeros(2, 4)})
    err = refusal(capsys, "--from-megatron", str(save_megatron(odd, tmp_path / "odd")),
                  str(tmp_path / "o"), "--model", spec_file(tmp_path, "llama"))
    assert "no place for: decoder.layers.mlp.linear_fc3.weight" in err
    zarr = save_megatron(megatron_llama_state(True), tmp_path / "zarr", backend="zarr")
    err = refusal(capsys, "--from-megatron", str(zarr), str(tmp_path / "o"),
                  "--model", spec_file(tmp_path, "llama"))
    assert "'zarr'" in err and "--ckpt-convert-format torch_dist" in err
    assert "megapar reads torch_dist checkpoints: convert it to torch_dist with" in err, err
    # a damaged metadata.json was "names the sharded backend None ... convert it" (a new user)
    info = next(zarr.rglob("metadata.json"))
    info.write_text("{")
    err = refusal(capsys, "--from-megatron", str(zarr), str(tmp_path / "o"),
                  "--model", spec_file(tmp_path, "llama"))
    assert "metadata.json is not readable JSON" in err and "the checkpoint is damaged" in err, err
    assert not (tmp_path / "o").exists()


MOE_ARGS = dict(num_layers=2, hidden_size=16, ffn_hidden_size=24, num_attention_heads=4,
                kv_channels=4, group_query_attention=True, num_query_groups=2,
                position_embedding_type="rope", untie_embeddings_and_output_weights=True,
                max_position_embeddings=16, num_experts=4, moe_router_topk=2,
                moe_ffn_hidden_size=12, moe_router_load_balancing_type="aux_loss",
                moe_aux_loss_coeff=0.01)
"""Megatron-LM's args for the moe fixture (those the import reads)."""


@pytest.mark.parametrize("changes, said", [
    ({"moe_router_pre_softmax": True}, "--moe-router-pre-softmax (the top k of a softmax over "
     "all experts, not renormalised"),
    ({"moe_router_score_function": "sigmoid", "moe_router_topk": 1},
     "--moe-router-score-function sigmoid with --moe-router-topk 1"),
    ({"moe_expert_capacity_factor": 1.0}, "--moe-expert-capacity-factor 1.0 (Megatron drops by "
     "--moe-token-drop-policy, megapar keeps each expert's first tokens; --model with a "
     "moe_capacity_factor of your choice imports the weights)"),
    ({"moe_router_num_groups": 2, "moe_router_group_topk": 1},
     "--moe-router-num-groups 2 (group-limited routing)"),
    ({"moe_router_topk_scaling_factor": 2.5}, "--moe-router-topk-scaling-factor 2.5"),
    ({"moe_router_load_balancing_type": "sinkhorn"}, "--moe-router-load-balancing-type sinkhorn"),
    ({"moe_layer_freq": [0, 1]}, "--moe-layer-freq [0, 1] (dense layers among the MoE ones)"),
], ids=["pre-softmax", "sigmoid-top1", "capacity", "groups", "scaling", "sinkhorn", "freq"])
def test_a_routing_megapars_mixtral_lacks_is_refused(tmp_path, capsys, changes, said):
    """The moe fixture's tensors with args naming a Megatron routing megapar does not compute:
    one line naming the option; the args as they were import (--model overrides them)."""
    root = tmp_path / "m"
    shutil.copytree(FIXTURES / "moe", root)
    common = root / "iter_0000007" / "common.pt"
    torch.save({"args": argparse.Namespace(**MOE_ARGS), "iteration": 7}, common)
    assert convert(["--from-megatron", str(root), str(tmp_path / "ok"), "--no-progress"]) == 0
    torch.save({"args": argparse.Namespace(**{**MOE_ARGS, **changes}), "iteration": 7}, common)
    err = refusal(capsys, "--from-megatron", str(root), str(tmp_path / "o"))
    assert f"its args say {said}" in err and "megapar's models lack" in err, err


def megatron_moe_state(extra: dict | None = None) -> dict:
    """A Mixtral-like GPT's tensors in Megatron's torch_dist names (layers stacked), random."""
    state = megatron_llama_state(True)
    g = torch.Generator().manual_seed(1)
    L = "decoder.layers.mlp."
    del state[L + "linear_fc1.weight"], state[L + "linear_fc2.weight"]
    shapes = {L + "router.weight": [2, 4, 16], L + "experts.experts.linear_fc1.weight": [2, 4, 24, 16],
              L + "experts.experts.linear_fc2.weight": [2, 4, 16, 12]}
    return state | {k: torch.randn(*v, generator=g) for k, v in shapes.items()} | (extra or {})


def test_moe_tensors_megapar_lacks_are_refused(tmp_path, capsys):
    spec = spec_file(tmp_path, "moe")
    L = "decoder.layers."
    for name, extra, said in [
        ("gated", {L + "mlp.shared_experts.gate_weight": torch.zeros(2, 1, 16)},
         "a gated shared expert (--moe-shared-expert-gate; megapar's shared experts have no "
         "gate) (decoder.layers.mlp.shared_experts.gate_weight)"),
        ("biased", {L + "mlp.router.bias": torch.zeros(2, 4)},
         "expert biases (--add-bias-linear with experts"),
        ("per-layer", {L + "0.mlp.router.weight": torch.zeros(4, 16)},
         "its layers are saved one by one (decoder.layers.0.mlp.router.weight)"),
        ("bias", {L + "mlp.router.expert_bias": torch.zeros(2, 4)},
         "no place for: decoder.layers.mlp.router.expert_bias (an expert bias: give a config "
         "with moe_bias_update_rate > 0)"),
        ("shared_expert", {L + "mlp.shared_experts.linear_fc1.weight": torch.zeros(2, 40, 16),
                    L + "mlp.shared_experts.linear_fc2.weight": torch.zeros(2, 16, 20)},
         "(a shared expert: give a config with shared_expert_intermediate_size)"),
    ]:
        root = save_megatron(megatron_moe_state(extra), tmp_path / name)
        err = refusal(capsys, "--from-megatron", str(root), str(tmp_path / "o"), "--model", spec)
        assert said in err, (name, err)
    root = save_megatron(megatron_moe_state(), tmp_path / "plain")
    reader = MegatronReader(root, spec)
    experts = megatron_moe_state()[L + "mlp.experts.experts.linear_fc1.weight"]
    assert torch.equal(reader.canonical("layers.1.mlp.experts.gate_up"), experts[1])
    assert not (tmp_path / "o").exists()


def test_load_of_a_megatron_directory_names_the_import(tmp_path):
    root = tmp_path / "m"
    shutil.copytree(FIXTURES / "gpt", root)
    for path in (root, root / "iter_0000007"):
        what = foreign_checkpoint(path)
        assert what is not None and "megapar-convert --from-megatron" in what, what


def test_a_directory_of_torch_save_pickles_is_named_not_trained_over(tmp_path):
    """--load of a directory holding model.pt (or pytorch_model.bin without a config.json, a
    Lightning .ckpt) said "no checkpoint there yet, starting from scratch" and the run saved
    into it (a checkpoints tryout): it is named as a PyTorch checkpoint megapar does not read,
    without reading it."""
    import io

    import pickle

    legacy, legacy4 = io.BytesIO(), io.BytesIO()
    torch.save({"w": torch.zeros(2)}, legacy, _use_new_zipfile_serialization=False)
    # (protocol 4 puts a frame between the protocol and the magic number: a re-test's finding)
    torch.save({"w": torch.zeros(2)}, legacy4, _use_new_zipfile_serialization=False,
               pickle_protocol=4)
    for name, saved in (("model.pt", None), ("pytorch_model.bin", legacy.getvalue()),
                        ("last.ckpt", None), ("weights.bin", legacy4.getvalue()),
                        ("state.pth", pickle.dumps({"w": 1}, protocol=5))):
        path = tmp_path / name.split(".")[0]
        path.mkdir()
        if saved is None:
            torch.save({"w": torch.zeros(2)}, path / name)
        else:
            (path / name).write_bytes(saved)
        what = foreign_checkpoint(path)
        assert what is not None and what.startswith(
            f"holds a PyTorch checkpoint ({name}: torch.save's pickle), not a megapar "
            f"checkpoint"), what
        assert "start from it with --from-hf DIR" in what, what
    # by what the file begins with, not its name alone: a .bin of tokens (megapar-data's,
    # without its .idx) or of other bytes was called a PyTorch checkpoint (a re-test)
    tokens = tmp_path / "tokens"
    tokens.mkdir()
    (tokens / "corpus.bin").write_bytes(torch.arange(128, 400, dtype=torch.int16).numpy().tobytes())
    # (ids 640 and 2698 first: the bytes a legacy pickle's protocol 2 begins with)
    (tokens / "ids.bin").write_bytes(torch.tensor([640, 2698, 5], dtype=torch.int16).numpy().tobytes())
    (tokens / "random.pt").write_bytes(os.urandom(64).replace(b"PK", b"pk"))
    assert foreign_checkpoint(tokens) is None


class _RunsCode:
    """Pickles as a call of os.system: what a hostile common.pt could hold."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_common_pt_is_read_without_running_it(tmp_path, capsys):
    marker = tmp_path / "ran"
    hostile = save_megatron(megatron_llama_state(True), tmp_path / "h",
                            common={"args": _RunsCode(marker), "iteration": 3})
    err = refusal(capsys, "--from-megatron", str(hostile), str(tmp_path / "o"))
    assert "records no training args" in err and not marker.exists()
    args = argparse.Namespace(num_layers=2, hidden_size=16, ffn_hidden_size=24,
                              num_attention_heads=4, group_query_attention=True,
                              num_query_groups=2, position_embedding_type="rope",
                              rotary_interleaved=True, hook=_RunsCode(marker))
    odd = save_megatron(megatron_llama_state(True), tmp_path / "i", common={"args": args})
    err = refusal(capsys, "--from-megatron", str(odd), str(tmp_path / "o"))
    assert "its args say --rotary-interleaved, which megapar's models lack" in err
    args.rotary_interleaved, args.num_layers = False, "two"
    odd = save_megatron(megatron_llama_state(True), tmp_path / "j", common={"args": args})
    err = refusal(capsys, "--from-megatron", str(odd), str(tmp_path / "o"))
    assert "common.pt's args: model config: num_hidden_layers='two'" in err
    assert not marker.exists()


def test_a_gpt_whose_kv_channels_are_not_its_head_size_is_refused(tmp_path):
    """Megatron's --kv-channels with learned positions (a GPT): megapar's GPT-2 splits hidden
    over its heads, and the value was dropped without a word (a migrant's finding: a common.pt
    of 8 heads of 16 channels at hidden 64 imported as heads of 8)."""
    from megapar.checkpoint.megatron import config_from_args
    from megapar.models.config import ConfigError

    args = argparse.Namespace(num_layers=2, hidden_size=64, num_attention_heads=8,
                              ffn_hidden_size=256, max_position_embeddings=16)
    assert config_from_args(argparse.Namespace(**vars(args), kv_channels=8), 64,
                            tmp_path).n_head == 8  # Megatron's default: hidden / heads
    with pytest.raises(ConfigError, match=r"its args say --kv-channels 16 with learned positions "
                       r"\(GPT-2's heads are hidden 64 / 8 heads = 8 wide\), which megapar's "
                       r"models lack"):
        config_from_args(argparse.Namespace(**vars(args), kv_channels=16), 64, tmp_path)
