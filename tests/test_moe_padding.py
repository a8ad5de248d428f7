"""Right-padded samples (`--sft-keys`' layout: labels -100 on the prompt and the padding, an
attention_mask of ones then zeros) train a mixture of experts at tp 2 with sequence
parallelism (also with each expert split over tp: the mask's column all-gathered with the
routing weights), pp 2 with full recomputation, dp 2 x ep 2 and cp 2 as one process: losses, grad
norms, the switch loss, the z-loss, the router statistics (no padding counted), the balancing
biases, first-step gradients and final weights (fp32, 1e-5 relative). Each rank takes its
tokens' slice of the mask (cp, SP) on every stage, as it takes the ids; that the terms equal
transformers' with attention_mask is test_models_moe.py's."""

import sys

import pytest
import test_moe_parallel
import torch
from test_moe_ep import _whole
from test_moe_parallel import G, LR, MAX_NORM, MBS, SEED, SEQ, VOCAB, WD, biases, check_rank
from test_moe_parallel import config, scheduler, serial_reference
from tp_utils import assert_close

from megapar.mesh import Layout, Mesh
from megapar.pipeline.partition import build_stage
from megapar.training.step import BatchPlan

STEPS, EPS = 1, 1e-4
_base_config = config


def padded_batches() -> list[dict]:
    """Rows of 2..SEQ tokens, right-padded; labels -100 on the first token and the padding."""
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (G, SEQ), generator=gen)
        lengths = torch.randint(2, SEQ + 1, (G, 1), generator=gen)
        lengths[0] = SEQ  # one whole row
        mask = (torch.arange(SEQ)[None] < lengths).long()
        labels = torch.where(mask.bool(), (ids + 1) % VOCAB, -100)
        labels[:, 0] = -100  # a prompt token
        out.append({"input_ids": torch.where(mask.bool(), ids, 0), "labels": labels,
                    "attention_mask": mask})
    return out


def _train(tp, pp, dp, ep, cp, sp, recompute, etp=1):
    import torch.distributed as dist

    from megapar.data_parallel import build_grad_sync
    from megapar.optim import Precision, build_optimizer
    from megapar.pipeline.executor import PipelineExecutor
    from megapar.training.step import TrainStep

    mesh = Mesh(Layout(tp, pp, dp, "tp-pp-dp", cp, ep), dist.get_rank(), sequence_parallel=sp,
                expert_tp=etp)
    model = build_stage(config(), mesh, SEED, recompute)
    executor = PipelineExecutor(model, mesh, "1f1b", (MBS, SEQ // cp // (tp if sp else 1), 32))
    optimizer = build_optimizer(model, mesh, LR, WD, eps=EPS, zero=0)
    grad_sync = build_grad_sync(model, mesh, 0, bucket_mb=0.02) if dp * cp > 1 else None
    step = TrainStep(model, mesh, executor, optimizer, scheduler(),
                     Precision("fp32", mesh.device), MAX_NORM, grad_sync)
    grads, optimizer_step = {}, optimizer.step

    def record_first_grads_then_step():
        if not grads:
            grads.update({n: _whole(p.grad, p, mesh).clone() for n, p in model.named_parameters()})
        optimizer_step()

    optimizer.step = record_first_grads_then_step
    plan = BatchPlan(G, MBS, dp)
    results = [step.step(plan.split(b, mesh.dp_rank), i) for i, b in enumerate(padded_batches())]
    weights = {n: _whole(p.detach(), p, mesh).clone() for n, p in model.named_parameters()}
    keep = mesh.dp_rank == 0 and mesh.tp_rank == 0 and mesh.cp_rank == 0
    return {"results": results, "weights": weights if keep else {},
            "grads": grads if keep else {}, "biases": biases(model)}


RUNS = {"tp2_sp": (2, 1, 1, 1, 1, True, "none"), "pp2_recompute": (1, 2, 1, 1, 1, False, "full"),
        "dp2_ep2": (1, 1, 2, 2, 1, False, "none"), "cp2": (1, 1, 1, 1, 2, False, "none"),
        "tp2_sp_etp2": (2, 1, 1, 1, 1, True, "none", 2)}


@pytest.fixture(scope="module")
def reference():
    return serial_reference(padded_batches())


def test_the_reference_counts_no_padding(reference):
    unpadded = sum(int(b["attention_mask"].sum()) for b in padded_batches())
    assert unpadded < G * SEQ * STEPS
    tokens = sum(sum(r["tokens_per_expert"]) for r in reference["routers"])
    assert tokens == config().num_moe_layers * config().num_experts_per_tok * unpadded


@pytest.mark.parametrize("layout", sorted(RUNS))
def test_padded_samples_train_a_moe_as_one_process(run, reference, layout):
    merged: dict = {"weights": {}, "grads": {}}
    for rank, out in enumerate(run(_train, 2, *RUNS[layout])):
        check_rank(out, f"{layout} rank {rank}", reference, merged)
    for key in merged:
        assert set(merged[key]) == set(reference[key]), f"{layout}: names differ"
        for name, t in merged[key].items():
            assert_close(t, reference[key][name], what=f"{layout} {key} {name}")


def _capacity_config():
    cfg = _base_config()
    cfg.moe_capacity_factor = 1.0  # drops: which assignments come first decides what is kept
    return cfg


def test_a_capacity_under_expert_tp_and_sp_keeps_what_one_process_keeps(run, monkeypatch):
    # under expert tp with sequence parallelism the tp ranks' slices of the micro-batch's
    # MBS = 2 rows are gathered rank by rank; routed in that order, "first come, first kept"
    # kept other assignments than one process (layout_fuzz: mixtral-tiny 1.5e-2 apart)
    for module in (test_moe_parallel, sys.modules[__name__]):
        monkeypatch.setattr(module, "config", _capacity_config)
    reference = serial_reference(padded_batches())
    assert any(r.get("dropped", 0) for r in reference["routers"]), "nothing was dropped"
    merged: dict = {"weights": {}, "grads": {}}
    for rank, out in enumerate(run(_train, 2, *RUNS["tp2_sp_etp2"])):
        check_rank(out, f"capacity tp2_sp_etp2 rank {rank}", reference, merged)
    for name, t in merged["weights"].items():
        assert_close(t, reference["weights"][name], what=f"capacity weights {name}")


def test_a_right_padding_mask_is_kept_for_a_moe_and_dropped_for_a_dense_decoder():
    """engine.train_step's batch check: a mixture of experts keeps a right-padding
    attention_mask (it routes no padding), a dense decoder drops it (causal attention keeps the
    padding out already), and a mask that is not right padding is refused for both."""
    from megapar.models.recipes import resolve_model
    from megapar.training.batch_check import check_batch

    batch = padded_batches()[0]
    assert torch.equal(check_batch(batch, config())["attention_mask"], batch["attention_mask"])
    dense = resolve_model("llama-tiny")
    assert "attention_mask" not in check_batch(batch, dense)
    left = {**batch, "attention_mask": batch["attention_mask"].flip(1)}
    for model in (config(), dense):
        with pytest.raises(ValueError, match="takes right padding only"):
            check_batch(left, model)
