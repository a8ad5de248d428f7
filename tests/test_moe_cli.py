"""megapar-train with mixture-of-experts models end to end on the CPU: the mixtral-tiny recipe at
pp 2 with the router statistics in --log-json, and a transformers Qwen3MoeForCausalLM trained
with --from-hf at tp 2 under a capacity factor, saved, exported with megapar-convert --to-hf and
loaded back by transformers with the logits megapar computes from the exported weights."""

import json
import os
import re
from pathlib import Path

import pytest
import torch
import transformers
from conftest import skip_unless_transformers_converts
from safetensors import safe_open
from safetensors.torch import load_file
from tp_utils import assert_close, make_mesh

import megapar.checkpoint.manifest as manifest_module
from megapar.checkpoint.convert import checkpoint_info, write_checkpoint
from megapar.checkpoint.distributed import load_checkpoint, planned_shard
from megapar.checkpoint.format import ShardReader
from megapar.checkpoint.hf import HFReader, load_hf_weights
from megapar.checkpoint.manifest import read_manifest
from megapar.cli.convert import main as convert
from megapar.cli.train import main
from megapar.data import asset_path
from megapar.mesh import Layout, Mesh
from megapar.models import Llama
from megapar.models.config import config_from_dict

TINY = ["--seq-len", "16", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--log-interval", "1", "--eval-interval", "0", "--no-progress", "--warmup-steps", "1",
        "--tokenizer", "sentencepiece"]


@pytest.fixture(scope="module")
def common(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_cli")
    text = root / "sample.txt"
    text.write_text(Path(asset_path("shakespeare_sample.txt")).read_text()[:20_000])
    return ["--data", str(text), "--data-cache", str(root / "cache"), *TINY]


def _records(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_mixtral_tiny_trains_at_pp2_with_router_statistics(tmp_path, common):
    log = tmp_path / "log.jsonl"
    assert main(["--model", "mixtral-tiny", "--pp", "2", "--max-steps", "3", "--lr", "3e-3",
                 "--moe-z-loss-coef", "0.001", "--log-json", str(log), *common]) == 0
    records = _records(log)
    assert len(records) == 3
    for r in records:
        # dropless: every token's 2 choices in each of the 4 MoE layers, 4 x 16 tokens a step
        assert sum(r["moe_tokens_per_expert"]) == 4 * 16 * 2 * 4, r
        assert len(r["moe_tokens_per_expert"]) == 4 and r["moe_dropped"] == 0.0
        assert r["moe_imbalance"] >= 1.0 and r["moe_aux_loss"] > 0 and r["moe_z_loss"] > 0


def test_from_hf_qwen3_moe_trains_and_exports_back_to_transformers(tmp_path, common, capsys):
    """A seeded transformers Qwen3-MoE (GQA), trained at tp 2 x dp 2 x ep 2 with a capacity
    that drops tokens, exported, loaded back by transformers: its logits are megapar's."""
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=1004, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=64))
    hf.save_pretrained(tmp_path / "hf")
    log, ckpt, out = tmp_path / "log.jsonl", tmp_path / "ckpt", tmp_path / "exported"
    assert main(["--from-hf", str(tmp_path / "hf"), "--tp", "2", "--dp", "2", "--ep", "2",
                 "--max-steps", "2",
                 "--moe-capacity-factor", "1.0", "--save", str(ckpt), "--save-interval", "2",
                 "--log-json", str(log), *common]) == 0
    assert all(r["moe_dropped"] > 0 for r in _records(log))  # capacity 1.0 drops some
    # a copy without flags keeps the whole layout, so the ranks' RNG states too: it had become
    # dp 1 (the --dp default) and ep 1 (never written), and dropped them
    capsys.readouterr()
    assert convert([str(ckpt / "step_00000002"), str(tmp_path / "copy"), "--no-progress"]) == 0
    assert capsys.readouterr().out.strip().endswith("(tp=2 pp=1 dp=2 ep=2)")
    copy = read_manifest(tmp_path / "copy")
    assert copy["layout"] == {"tp": 2, "pp": 1, "dp": 2, "ep": 2}
    assert "rng.safetensors" in copy["files"] and "rng_note" not in copy["meta"]
    skip_unless_transformers_converts()  # --to-hf exports the SentencePiece tokenizer too
    assert convert([str(ckpt / "step_00000002"), "--to-hf", str(out)]) == 0
    back = transformers.Qwen3MoeForCausalLM.from_pretrained(str(out)).eval()
    reader = HFReader(str(out))
    ours = Llama(reader.config, make_mesh(1))
    load_hf_weights(ours, reader)
    ids = torch.randint(0, 1004, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert_close(ours.eval()(None, {"input_ids": ids})[..., :1004], back(ids).logits,
                     what="exported model's logits")
        assert not torch.allclose(back(ids).logits, hf.eval()(ids).logits)  # it trained


def test_mixtral_dry_run_rehearses_pp2_dp2_ep2(common, capsys):
    """The dry run's fake tensors have no values: the expert loop and the ep route take the
    tokens as spread evenly (`moe.host_counts`, `plan_route`) and the rehearsal completes,
    under full recomputation (the recompute reuses the forward's route); the header names ep."""
    assert main(["--model", "mixtral-tiny", "--dry-run", "--pp", "2", "--dp", "2", "--ep", "2",
                 "--recompute", "full", *common]) == 0
    assert "dp 2 with ep 2 in dp" in capsys.readouterr().out


def test_mixtral_tiny_trains_at_dp2_cp2_ep2_as_at_dp2(tmp_path, common):
    """megapar-train --dp 2 --cp 2 --ep 2: ep folds into dp x cp, so the two cp ranks of each
    sequence hold 2 of the 4 experts each and exchange their chunks' tokens; the losses, grad
    norms and router statistics are those of --dp 2 (ep 1, no cp) over 2 steps, and so is the
    checkpoint each saves at step 2 (every expert and its moments whole, gathered over the ep
    group of the writer, both its cp ranks). Each run's step-1 checkpoint resumes in the
    other's layout (cp 2 x ep 2 at ep 1, and ep 1 at cp 2 x ep 2) with step 2's loss (1e-6).
    AdamW's epsilon is 1e-4 (as test_moe_ep's): at 1e-8 an element whose gradient is near 0
    takes a step of about lr whichever way its rounding goes, and the saved weights and moments
    differ by more than 1e-5 between any two layouts (cp alone, ep alone)."""
    runs, saved = {}, {}
    layouts = {"ep1": ["--dp", "2"], "cp2ep2": ["--dp", "2", "--cp", "2", "--ep", "2"]}
    for run, layout in layouts.items():
        log = tmp_path / f"{run}.jsonl"
        assert main(["--model", "mixtral-tiny", *layout, "--max-steps", "2", "--lr", "3e-3",
                     "--adam-eps", "1e-4", "--save", str(tmp_path / run), "--save-interval", "1",
                     "--log-json", str(log), *common]) == 0
        runs[run] = _records(log)
        saved[run], _ = _canonical(tmp_path / run / "step_00000002")
    assert len(runs["cp2ep2"]) == 2
    for one, two in zip(runs["ep1"], runs["cp2ep2"]):
        for key in ("loss", "grad_norm", "moe_aux_loss", "moe_z_loss"):
            assert_close(torch.tensor(two[key]), torch.tensor(one[key]), what=key)
        assert two["moe_tokens_per_expert"] == one["moe_tokens_per_expert"]
    assert set(saved["cp2ep2"]) == set(saved["ep1"])
    assert any("experts" in name for name in saved["ep1"])
    for name, want in saved["ep1"].items():
        assert_close(saved["cp2ep2"][name], want, what=f"saved {name}")
    for run, other in (("ep1", "cp2ep2"), ("cp2ep2", "ep1")):  # resumed in the other layout
        log = tmp_path / f"{run}_from_{other}.jsonl"
        assert main(["--model", "mixtral-tiny", *layouts[run], "--max-steps", "2", "--lr", "3e-3",
                     "--adam-eps", "1e-4", "--load", str(tmp_path / other / "step_00000001"),
                     "--log-json", str(log), *common]) == 0
        (resumed,) = _records(log)
        want = runs[run][1]["loss"]
        assert resumed["step"] == 2 and abs(resumed["loss"] - want) / want < 1e-6, (run, resumed)


def test_ep_on_a_dense_model_is_refused_in_one_line(common, capsys):
    assert main(["--model", "llama-tiny", "--dp", "2", "--ep", "2", "--max-steps", "1",
                 *common]) != 0
    err = [line for line in capsys.readouterr().err.splitlines() if "--ep" in line]
    assert len(err) == 1 and "has no experts: use --ep 1" in err[0], err


@pytest.mark.parametrize("model,tp,etp,words", [
    ("mixtral-tiny", "2", "3", "must be 1 (experts whole on every tp rank) or the tp size --tp 2"),
    ("llama-tiny", "2", "2", "has no experts: use --expert-tensor-parallel-size 1"),
    # at tp 1 a dense model was told "the tp size --tp 1", not that it has no experts (a
    # fuzz run's finding)
    ("llama-tiny", "1", "2", "has no experts: use --expert-tensor-parallel-size 1")])
def test_an_expert_tensor_parallel_size_it_cannot_take_is_refused_in_one_line(
        common, capsys, model, tp, etp, words):
    """Neither 1 nor --tp, or on a model without experts: one line, exit 2, no worker."""
    assert main(["--model", model, "--tp", tp, "--expert-tensor-parallel-size", etp,
                 "--max-steps", "1", *common]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err


def test_experts_whole_on_every_tp_rank_by_default_is_said_once(common):
    """A MoE model at --tp 2 without --expert-tensor-parallel-size (megapar's default 1,
    Megatron-core's the tp size) gets one start-up note where the choice matters (the split
    saves a rank at least 1 GiB: mixtral-8x7b here, 171.5 vs 87.5 GiB at pp 4): every tp rank
    holds every expert whole (its ep share under --ep), and the flag at 2 splits them, with
    the state a rank holds either way; none for mixtral-tiny (4 vs 3 MiB a rank here: it
    printed), when the flag is given, at --tp 1, or for a dense model."""
    from megapar.cli.train import plan_run
    from megapar.dryrun.modelled import expert_tp_note
    from megapar.mesh import Layout
    from megapar.models.recipes import resolve_model
    from megapar.training.config import TrainConfig, parse_args

    def said(*argv):
        notes: list[str] = []
        plan_run(parse_args([*argv, "--max-steps", "1", *common]), notes)
        return [n for n in notes if "--expert-tensor-parallel-size" in n]

    def planned(layout):
        cfg = TrainConfig(tp=layout.tp, pp=layout.pp, dp=layout.dp, ep=layout.ep, seq_len=4096,
                          micro_batch_size=1, global_batch_size=64)
        return expert_tp_note(cfg, resolve_model("mixtral-8x7b"), layout, False)

    [note] = planned(Layout(2, 4, 1))
    assert note.startswith(
        "--expert-tensor-parallel-size not given: 1 (Megatron-core's default is --tp), so each "
        "of the 2 tp ranks holds every routed expert whole ("), note
    assert " of parameters, gradients and optimizer state a rank, megapar-plan's count); " \
        "--expert-tensor-parallel-size 2 splits each expert over them (" in note, note
    whole, split = (float(m) for m in re.findall(r"\(([\d.]+) GiB", note))
    assert whole - split >= 1, note
    # under --ep a tp rank holds its ep share of the experts, not every one
    [ep] = planned(Layout(2, 4, 2, ep=2))
    assert ep.startswith(
        "--expert-tensor-parallel-size not given: 1 (Megatron-core's default is --tp), so each "
        "of the 2 tp ranks holds its 4 of the 8 routed experts of each MoE layer (--ep 2) "
        "whole ("), ep
    assert said("--model", "mixtral-tiny", "--tp", "2") == []  # 4 vs 3 MiB: no matter
    assert said("--model", "mixtral-tiny", "--tp", "2", "--expert-tensor-parallel-size", "1") == []
    assert said("--model", "mixtral-tiny") == []
    assert said("--model", "llama-tiny", "--tp", "2") == []


def test_a_capacity_over_a_split_sequence_is_said_to_depend_on_the_layout(common):
    """An expert capacity counts a rank's own tokens; under cp (or sequence parallelism) a rank
    holds a share of a sequence, so the tokens dropped differ from one process (an experts
    tryout: qwen3-moe-tiny at cp 2 dropped 16.9 % against 14.7 %, without a word). A start-up
    note says so; none dropless, or without a split sequence."""
    from megapar.cli.train import plan_run
    from megapar.training.config import parse_args

    def said(*argv):
        notes: list[str] = []
        plan_run(parse_args([*argv, "--max-steps", "1", "--model", "mixtral-tiny", *common]),
                 notes)
        return [n for n in notes if "capacity" in n]

    [note] = said("--cp", "2", "--moe-capacity-factor", "1.25")
    assert note.startswith("an expert capacity factor of 1.25 (--moe-capacity-factor, or the "
                           "model config's moe_capacity_factor) under --cp 2: each rank's "
                           "expert capacity counts its own share"), note
    [note] = said("--tp", "2", "--sequence-parallel", "--moe-capacity-factor", "1")
    assert "under --sequence-parallel at --tp 2: " in note, note
    assert said("--cp", "2") == said("--tp", "2", "--moe-capacity-factor", "1") == []
    assert said("--dp", "2", "--ep", "2", "--moe-capacity-factor", "1") == []
    # the experts split over tp gather the sequence's tokens: one process's capacity (a
    # guide's tryout: the note was said, and the run gave one process's numbers)
    assert said("--tp", "2", "--sequence-parallel", "--moe-capacity-factor", "1",
                "--expert-tensor-parallel-size", "2") == []


def _canonical(step_dir):
    """{name or name/moment: the whole tensor} of a checkpoint, through its reader."""
    manifest = read_manifest(step_dir)
    reader, out = ShardReader(step_dir, manifest), {}
    for name, e in manifest["tensors"].items():
        local = None if e["tp_dim"] is None else e["full_shape"][e["tp_dim"]]
        out[name] = reader.shard(name, None, 1, 0, local)
        out.update({f"{name}/{k}": reader.shard(name, k, 1, 0, local) for k in e["optim"]})
    return out, manifest


def test_mixtral_checkpoint_reshards_over_ep_zero_and_layouts(tmp_path, common):
    """Experts, their optimizer state and the auxiliary-loss-free bias reshard like any tensor,
    under ZeRO-3 too. A run at pp 2 x dp 2 x ep 2 under ZeRO-1 with the bias moving saves at
    steps 2 and 4 (every expert and its moments whole, gathered over ep from each
    expert-data-parallel group's slices; the bias kept). Resumed from step 2 at dp 4 x ep 2
    under ZeRO-3 (the experts' units sharded over an expert-data-parallel group of 2), it runs
    step 3 and saves there (the units gathered, the experts whole over ep). That ZeRO-3
    checkpoint resumes at dp 4 x ep 4 (ZeRO-2), at dp 2 x ep 2 (ZeRO-3, another dp), at tp 2 x
    dp 2 (ep 1, ZeRO-1) after megapar-convert rewrote it for tp 2, and at tp 2 x dp 2 x ep 2
    (ZeRO-3) from the same conversion: every resumed step's loss is the straight run's (1e-6),
    and what each saves at step 4 is what the straight run saves there: weights, moments and
    bias (1e-5)."""
    args = ["--model", "mixtral-tiny", "--lr", "3e-3", "--max-steps", "4",
            "--moe-bias-update-rate", "0.05", "--save-interval", "2", *common,
            "--micro-batch-size", "1"]
    ck, z3, tp2 = tmp_path / "straight_ck", tmp_path / "z3_ck" / "step_00000003", tmp_path / "tp2"
    runs = {"straight": ["--pp", "2", "--dp", "2", "--ep", "2", "--zero", "1"],
            "z3": ["--dp", "4", "--ep", "2", "--zero", "3", "--load", str(ck / "step_00000002"),
                   "--exit-interval", "3"],
            "ep4": ["--dp", "4", "--ep", "4", "--zero", "2", "--load", str(z3)],
            "z3dp2": ["--dp", "2", "--ep", "2", "--zero", "3", "--load", str(z3)],
            "tp2": ["--tp", "2", "--dp", "2", "--zero", "1", "--load", str(tp2)],
            "tp2z3": ["--tp", "2", "--dp", "2", "--ep", "2", "--zero", "3", "--load", str(tp2)]}
    losses, saved = {}, {}
    for run, layout in runs.items():
        log = tmp_path / f"{run}.jsonl"
        assert main([*args, *layout, "--save", str(tmp_path / f"{run}_ck"),
                     "--log-json", str(log)]) == 0
        losses[run] = {r["step"]: r["loss"] for r in _records(log)}
        if run == "z3":  # its step-3 checkpoint rewritten for tp 2
            assert convert([str(z3), str(tp2), "--tp", "2", "--pp", "1", "--no-progress"]) == 0
            written = json.loads((tp2 / "step_00000003" / "manifest.json").read_text())
            assert written["layout"]["ep"] == 2, written["layout"]  # kept (it was dropped)
        else:
            saved[run], _ = _canonical(tmp_path / f"{run}_ck" / "step_00000004")
    assert set(losses["z3"]) == {3}
    for run in runs:
        if run == "straight":
            continue
        assert set(losses[run]) <= {3, 4}, (run, losses[run])
        for step, loss in losses[run].items():
            assert abs(loss - losses["straight"][step]) / loss < 1e-6, (run, losses)
        if run == "z3":
            continue
        assert set(losses[run]) == {4}, (run, losses[run])
        assert set(saved[run]) == set(saved["straight"])
        for name, want in saved["straight"].items():
            assert_close(saved[run][name], want, what=f"{run} {name}")
    for step_dir in (ck / "step_00000002", z3):  # what the resumes started from
        at, manifest = _canonical(step_dir)
        biases = [n for n, e in manifest["tensors"].items() if e.get("buffer")]
        assert len(biases) == 4 and all(n.endswith("router.bias") for n in biases), biases
        assert sum(at[n].abs().sum() for n in biases) > 0  # it moved: the routing depends on it
        assert all(e["optim"] for e in manifest["tensors"].values() if not e.get("buffer"))
    assert "layout      tp=1 pp=1 dp=4 ep=2\n" in checkpoint_info(z3, checksums=False)
    # the dry run's size of that file: every expert whole, as written (an ep rank's own model)
    mesh = Mesh.virtual(Layout(dp=4, ep=2), rank=1, device="meta")
    model = Llama(config_from_dict(manifest["model"]), mesh)
    moments = {n: {"exp_avg": p, "exp_avg_sq": p} for n, p in model.named_parameters()}
    assert planned_shard(model, mesh, moments) == (
        "model_tp00_pp00.safetensors", (z3 / "model_tp00_pp00.safetensors").stat().st_size)


@pytest.mark.parametrize("what", ["sigmoid", "shared-experts", "bias"])
def test_export_of_a_moe_transformers_cannot_hold_is_refused(tmp_path, what, capsys):
    """A sigmoid router, shared experts or a non-zero balancing bias (DeepSeek-style parts no
    transformers Mixtral / Qwen3-MoE has) is refused in one line, nothing written; before,
    the export loaded in transformers with other logits (0.08 off at 4 layers, hidden 64)."""
    from megapar.checkpoint.distributed import save_checkpoint
    from megapar.models import Qwen3MoeConfig
    from megapar.pipeline.partition import build_stage

    extra = {"sigmoid": {"moe_router_score": "sigmoid"},
             "shared-experts": {"shared_expert_intermediate_size": 16},
             "bias": {"moe_bias_update_rate": 0.01}}[what]
    config = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                            moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=16, max_position_embeddings=32,
                            num_local_experts=4, num_experts_per_tok=2, **extra)
    mesh = Mesh(Layout(1, 1, 1))
    model = build_stage(config, mesh, 0)
    for name, b in model.named_buffers():
        if name.endswith("router.bias"):
            b.copy_(torch.tensor([0.01, -0.01, 0.0, 0.0]))
    save_checkpoint(tmp_path / "ckpt", 1, model, mesh, {}, {}, {})
    out = tmp_path / "hf"
    assert convert([str(tmp_path / "ckpt"), "--to-hf", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Qwen3MoeForCausalLM" in err, err
    assert ("router.bias is not zero" if what == "bias" else "does not have") in err, err
    # the fix in megapar-train's flag (it named the config key moe_bias_update_rate 0)
    assert what != "bias" or err.endswith("or train with --moe-bias-update-rate 0 to export")
    assert not out.exists()


def _save_qwen3_moe(path, **overrides):
    """A tiny seeded transformers Qwen3-MoE (4 experts, top 2; one layer unless `overrides`
    say otherwise), saved to `path`; returns the model."""
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**{
        **dict(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
               max_position_embeddings=32, num_experts=4, num_experts_per_tok=2),
        **overrides}))
    hf.save_pretrained(path)
    return hf


def test_from_hf_with_megapar_only_moe_settings_is_refused(tmp_path, capsys):
    """A transformers config.json with megapar's own MoE settings (a sigmoid router, shared
    experts) loads in transformers without them; megapar imported it as another model (the
    router changed, the shared experts initialised from the seed, with a note). Now refused in
    one line, nothing written."""
    _save_qwen3_moe(tmp_path / "hf")
    assert convert(["--from-hf", str(tmp_path / "hf"), str(tmp_path / "ok"), "--no-progress"]) == 0
    raw = json.loads((tmp_path / "hf" / "config.json").read_text())
    raw.update(moe_router_score="sigmoid", shared_expert_intermediate_size=16)
    (tmp_path / "hf" / "config.json").write_text(json.dumps(raw))
    capsys.readouterr()
    out = tmp_path / "ckpt"
    assert convert(["--from-hf", str(tmp_path / "hf"), str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "moe_router_score='sigmoid', shared_expert_intermediate_size=16" in err, err
    assert "remove them from config.json" in err and not out.exists(), err


def test_info_names_the_experts_and_the_active_parameters(tmp_path):
    """--info's model line of a mixture of experts names its routed experts (how many, how wide,
    the top-k, in which share of the layers) and its active parameters per token: transformers'
    count less the experts a token is not routed to. It gave layers, hidden and vocab alone."""
    hf = _save_qwen3_moe(tmp_path / "hf", num_hidden_layers=3, mlp_only_layers=[0])
    assert convert(["--from-hf", str(tmp_path / "hf"), str(tmp_path / "ck"), "--no-progress"]) == 0
    experts = hf.model.layers[1].mlp.experts
    per_expert = sum(p.numel() for p in experts.parameters()) // 4
    active = hf.num_parameters() - 2 * (4 - 2) * per_expert  # 2 MoE layers, 2 idle experts
    assert (f"qwen3_moe (3 layers, hidden 32, vocab 64; 4 routed experts of 16, top 2, softmax "
            f"router, in 2 of its layers), {hf.num_parameters():,} parameters (unpadded, as "
            f"transformers counts them; {active:,} active per token)") in checkpoint_info(
        tmp_path / "ck"), active
    # the router's score and a shared expert, which --to-hf refuses for a Mixtral, are named
    # (a new user's tryout of moe.md)
    from megapar.checkpoint.convert import _size
    from megapar.models.recipes import resolve_model

    mixtral = {**resolve_model("mixtral-tiny").to_dict(), "moe_router_score": "sigmoid",
               "shared_expert_intermediate_size": 32, "moe_bias_update_rate": 0.001}
    assert _size(mixtral).endswith("top 2, sigmoid router, a shared expert of 32, "
                                   "auxiliary-loss-free bias (rate 0.001), in 4 of its layers"
                                   ), _size(mixtral)


def test_qwen3_moe_export_names_its_experts_as_the_hub_does(tmp_path):
    """A Qwen3-MoE export's config.json carries its routed experts under the hub's key
    `num_experts` (what transformers 4's Qwen3MoeConfig reads; without it, it builds its
    default 128 experts and cannot load the 4 exported) beside transformers 5's
    `num_local_experts`; transformers 5 and megapar read it back with 4 experts."""
    _save_qwen3_moe(tmp_path / "hf")
    ck, out = tmp_path / "ck", tmp_path / "exported"
    assert convert(["--from-hf", str(tmp_path / "hf"), str(ck), "--no-progress"]) == 0
    assert convert([str(ck), "--to-hf", str(out), "--no-progress"]) == 0
    raw = json.loads((out / "config.json").read_text())
    assert raw.get("num_experts") == raw["num_local_experts"] == 4, raw
    back = transformers.Qwen3MoeForCausalLM.from_pretrained(str(out))
    assert back.model.layers[0].mlp.experts.gate_up_proj.shape[0] == 4
    assert HFReader(str(out)).config.num_local_experts == 4


def _old_form(step_dir, dst):
    """`step_dir` rewritten as checkpoints were written before the experts were split over the
    tp files: every routed expert's stack (weights and moments) whole in every tp file, its
    manifest entry with no tp split (the writer's rule then, which megapar-convert's plan
    followed too)."""
    manifest = read_manifest(step_dir)
    reader, entries = ShardReader(step_dir, manifest), {}
    for name, e in manifest["tensors"].items():
        whole = ".experts." in name
        entries[name] = dict(e, tp_dim=None, local_shape=e["full_shape"]) if whole else e

    def fill(name, key, t, local):
        return reader.shard(name, key, 2, t, None if ".experts." in name else local)

    layout = Layout(**manifest["layout"])
    return write_checkpoint(dst, manifest["step"], layout, config_from_dict(manifest["model"]),
                            manifest["meta"], entries, fill, progress=False)


def _safetensors_keys(path):
    with safe_open(str(path), framework="pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def test_experts_are_saved_once_split_over_the_tp_files_and_resume_in_any_form(
        tmp_path, common, capfd, monkeypatch):
    """A run at --tp 2 --dp 2 --ep 2 --zero 1 --expert-tensor-parallel-size 2 (each expert's
    weights split over tp, its state over ZeRO-1's expert-dp slices) saves each routed expert's
    stack (weights and moments) once, split along the experts over the two tp files (tp rank r's
    file experts [2r, 2r + 2) of 4; manifest tp_dim 0): the expert bytes of the two files are one
    copy of the stacks, not two; the dry run's file size is the file's. Its step-1 checkpoint
    resumes at --tp 2 with the experts unsplit (ETP 1, ep 1, dp 1) with step 2's loss (1e-6),
    every file of it hashed once, by the launcher before its two workers start (which check
    only the sizes of what they read), and saves at step 2 (an ETP 1 file, its experts split the same way), which resumes at one
    process with step 3's loss and saves at step 3 what the straight run saves (1e-5), and
    loads in its own layout unresharded, its RNG states restored. The same step-2 checkpoint
    rewritten in the old form (every expert whole in every tp file, no tp split) resumes at
    --tp 2 --expert-tensor-parallel-size 2 with step 3's loss, and megapar-convert rewrites it
    as the run wrote it, bit for bit. megapar-convert of the step-1
    checkpoint to tp 1 and back to tp 2 gives the run's own files bit for bit, and the
    transformers export of the tp 2 checkpoint is that of the tp 1 one, bit for bit."""
    args = ["--model", "mixtral-tiny", "--lr", "3e-3", "--adam-eps", "1e-4", "--max-steps", "3",
            *common]
    straight, etp1, old = tmp_path / "etp2", tmp_path / "etp1", tmp_path / "old"
    runs = {"etp2": ["--tp", "2", "--dp", "2", "--ep", "2", "--zero", "1",
                     "--expert-tensor-parallel-size", "2", "--save-interval", "1"],
            "etp1": ["--tp", "2", "--load", str(straight / "step_00000001"),
                     "--exit-interval", "2"],
            "one": ["--load", str(etp1 / "step_00000002")],
            "old": ["--tp", "2", "--expert-tensor-parallel-size", "2", "--load", str(old)]}
    losses, saved = {}, {}
    hashed = tmp_path / "hashed.txt"  # (process, file) of every file hashed on load
    record = manifest_module.file_record

    def hashing(path):
        with open(hashed, "a") as f:
            f.write(f"{os.getpid()} {Path(path).name}\n")
        return record(path)

    for run, layout in runs.items():
        if run == "old":
            _old_form(etp1 / "step_00000002", old)
        log = tmp_path / f"{run}.jsonl"
        save = tmp_path / (run if run != "old" else "old_ck")
        if run == "etp1":  # the workers are forked: they hash through the patched function
            monkeypatch.setattr(manifest_module, "file_record", hashing)
        assert main([*args, *layout, "--save", str(save), "--log-json", str(log)]) == 0
        monkeypatch.undo()
        losses[run] = {r["step"]: r["loss"] for r in _records(log)}
    files = sorted(p.name for p in (straight / "step_00000001").glob("*.safetensors"))
    assert sorted(hashed.read_text().splitlines()) == [f"{os.getpid()} {f}" for f in files]
    # the resume note names the change the layout (tp 2 both times) does not show
    assert "; --expert-tensor-parallel-size 2 -> 1)" in "".join(capfd.readouterr())
    assert set(losses["etp1"]) == {2} and set(losses["one"]) == set(losses["old"]) == {3}
    for run in ("etp1", "one", "old"):
        for step, loss in losses[run].items():
            want = losses["etp2"][step]
            assert abs(loss - want) / want < 1e-6, (run, losses)
    saved["etp2"], _ = _canonical(straight / "step_00000003")
    saved["one"], _ = _canonical(tmp_path / "one" / "step_00000003")
    assert set(saved["one"]) == set(saved["etp2"])
    for name, want in saved["etp2"].items():
        assert_close(saved["one"][name], want, what=f"saved {name}")
    for step_dir in (straight / "step_00000001", etp1 / "step_00000002"):
        manifest = read_manifest(step_dir)
        experts = [n for n in manifest["tensors"] if ".experts." in n]
        assert len(experts) == 8, experts  # gate_up and down of 4 MoE layers
        files = [_safetensors_keys(step_dir / f"model_tp0{t}_pp00.safetensors") for t in (0, 1)]
        for name in experts:
            e = manifest["tensors"][name]
            assert e["tp_dim"] == 0 and e["local_shape"] == [2, *e["full_shape"][1:]], e
            for key in [f"model/{name}"] + [f"optim/{name}/{k}" for k in e["optim"]]:
                assert [f[key][0] for f in files] == [2, 2]  # 2 + 2 rows: the 4 experts once
        assert sorted(manifest["tensors"][experts[0]]["optim"]) == ["exp_avg", "exp_avg_sq"]
    # the old-form fixture holds each stack whole in both files; read as such, megapar-convert
    # rewrites it as the run wrote it, bit for bit
    new = tmp_path / "new"
    assert convert([str(old), str(new), "--tp", "2", "--pp", "1", "--no-progress"]) == 0
    for t in (0, 1):
        name = f"model_tp0{t}_pp00.safetensors"
        down = _safetensors_keys(old / "step_00000002" / name)["model/layers.0.mlp.experts.down"]
        assert down[0] == 4
        want = load_file(etp1 / "step_00000002" / name)
        got = load_file(new / "step_00000002" / name)
        assert set(got) == set(want) and all(torch.equal(got[k], v) for k, v in want.items())
    # in its own layout a step-2 checkpoint loads unresharded, with its RNG states
    config = config_from_dict(read_manifest(etp1 / "step_00000002")["model"])
    for rank in (0, 1):
        mesh = Mesh.virtual(Layout(2, 1, 1), rank=rank, device="cpu")
        state = load_checkpoint(etp1 / "step_00000002", Llama(config, mesh), mesh)
        assert not state.resharded and state.rng is not None, state.notes
    # megapar-convert to tp 1 and back: the run's tp 2 files bit for bit
    step1 = straight / "step_00000001"
    tp1, back = tmp_path / "tp1", tmp_path / "back"
    assert convert([str(step1), str(tp1), "--tp", "1", "--pp", "1", "--no-progress"]) == 0
    assert convert([str(tp1), str(back), "--tp", "2", "--pp", "1", "--no-progress"]) == 0
    for t in (0, 1):
        name = f"model_tp0{t}_pp00.safetensors"
        want, got = load_file(step1 / name), load_file(back / "step_00000001" / name)
        assert set(got) == set(want) and all(torch.equal(got[k], v) for k, v in want.items())
    # the dry run's size of a tp rank's file: its block of the experts, as written
    mesh = Mesh.virtual(Layout(2, 1, 2, ep=2), rank=1, device="meta", expert_tp=2)
    model = Llama(config, mesh)
    moments = {n: {"exp_avg": p, "exp_avg_sq": p} for n, p in model.named_parameters()}
    assert planned_shard(model, mesh, moments) == (
        "model_tp01_pp00.safetensors", (step1 / "model_tp01_pp00.safetensors").stat().st_size)
    skip_unless_transformers_converts()  # --to-hf exports the SentencePiece tokenizer too
    exported = {}
    for ck in (step1, tp1):
        out = tmp_path / f"hf_{ck.name}"
        assert convert([str(ck), "--to-hf", str(out), "--no-progress"]) == 0
        exported[ck] = load_file(out / "model.safetensors")
    assert set(exported[step1]) == set(exported[tp1])
    assert all(torch.equal(exported[tp1][k], v) for k, v in exported[step1].items())


def test_experts_tp_does_not_divide_are_padded_in_the_last_tp_file(tmp_path, common):
    """3 routed experts at --tp 2: each tp file holds ceil(3 / 2) = 2 expert rows, tp rank 0's
    experts 0 and 1, tp rank 1's expert 2 and a row of zeros (padded as a vocabulary is), in
    weights and moments, whether each expert is split over tp (--expert-tensor-parallel-size 2)
    or whole on every tp rank (1); the two runs' step-1 checkpoints hold the same tensors (1e-5),
    and the first's resumes at one process with step 2's loss (1e-6)."""
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=1004, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        max_position_embeddings=64, num_experts=3, num_experts_per_tok=2))
    hf.save_pretrained(tmp_path / "hf")
    args = ["--lr", "3e-3", "--adam-eps", "1e-4", "--max-steps", "2", *common]
    runs = {"etp2": ["--from-hf", str(tmp_path / "hf"), "--tp", "2",
                     "--expert-tensor-parallel-size", "2", "--save-interval", "1"],
            "etp1": ["--from-hf", str(tmp_path / "hf"), "--tp", "2", "--exit-interval", "1"],
            "one": ["--load", str(tmp_path / "etp2" / "step_00000001")]}
    losses, saved = {}, {}
    for run, layout in runs.items():
        log = tmp_path / f"{run}.jsonl"
        assert main([*args, *layout, "--save", str(tmp_path / run), "--log-json", str(log)]) == 0
        losses[run] = {r["step"]: r["loss"] for r in _records(log)}
    assert set(losses["one"]) == {2}
    assert abs(losses["one"][2] - losses["etp2"][2]) / losses["etp2"][2] < 1e-6, losses
    for run in ("etp2", "etp1"):
        step_dir = tmp_path / run / "step_00000001"
        saved[run], manifest = _canonical(step_dir)
        e = manifest["tensors"]["layers.0.mlp.experts.down"]
        assert e["tp_dim"] == 0 and e["full_shape"][0] == 3 and e["local_shape"][0] == 2, e
        last = load_file(step_dir / "model_tp01_pp00.safetensors")
        for key in ("model/layers.0.mlp.experts.down", "optim/layers.0.mlp.experts.down/exp_avg"):
            assert last[key].shape[0] == 2 and last[key][0].abs().sum() > 0, key
            assert not last[key][1].any(), key  # the padding row
    assert set(saved["etp1"]) == set(saved["etp2"])
    for name, want in saved["etp2"].items():
        assert_close(saved["etp1"][name], want, what=f"saved {name}")
