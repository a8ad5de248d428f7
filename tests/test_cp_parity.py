"""Context parallelism gives the numbers of one process: the loss of a global batch and every
gradient, for GPT-2 (ring attention), Llama with grouped-query heads (all-gather attention; the
ring too), Mistral with a sliding window shorter than the sequence (at cp 2 and 4 alone, and
tp 2 x cp 2 x pp 2 by the ring) and BERT with padding (ring, bidirectional), at cp 2 and 4
combined with tp 2
(with and without sequence parallelism), pp 2 (every schedule), dp 2 (ZeRO-1), and recompute
none / selective / full. fp32, relative error < 1e-5 against the serial model on the same
global batch (the 3-step run with clipping at tp x cp x pp = 2 x 2 x 2 is in
test_parity_3d.py). A bf16 run at cp 2 is compared with bf16 at cp 1.
"""

import pytest
import torch
from tp_utils import assert_close, gather_grads, rel_err, to_device

from megapar.launcher import run_local
from megapar.mesh import Layout, Mesh
from megapar.models import BertConfig, GPT2Config, LlamaConfig, MistralConfig
from megapar.pipeline.partition import build_stage
from megapar.tensor_parallel.partition import gather_full, unpad
from megapar.training.step import BatchPlan

SEED, G, MBS, SEQ, VOCAB, H = 3, 4, 2, 16, 64, 32
CONFIGS = {
    "gpt2": lambda: GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=H, n_layer=4, n_head=4,
                               resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                               make_vocab_size_divisible_by=8),
    "llama": lambda: LlamaConfig(vocab_size=VOCAB, hidden_size=H, intermediate_size=2 * H,
                                 num_hidden_layers=4, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=SEQ,
                                 make_vocab_size_divisible_by=8, tie_word_embeddings=False),
    # a sliding window of 5 cutting the sequence of 16 (a cp rank's chunks: 8 or 4 tokens)
    "mistral": lambda: MistralConfig(vocab_size=VOCAB, hidden_size=H, intermediate_size=2 * H,
                                     num_hidden_layers=4, num_attention_heads=4,
                                     num_key_value_heads=2, max_position_embeddings=SEQ,
                                     make_vocab_size_divisible_by=8, sliding_window=5),
    "bert": lambda: BertConfig(vocab_size=VOCAB, hidden_size=H, num_hidden_layers=4,
                               num_attention_heads=4, intermediate_size=2 * H,
                               max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                               attention_probs_dropout_prob=0.0, make_vocab_size_divisible_by=8),
}


def global_batch(kind: str, g: int = G) -> dict:
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (g, SEQ), generator=gen)
    if kind != "bert":
        return {"input_ids": ids, "labels": (ids + 1) % VOCAB}
    lengths = torch.tensor([SEQ, 11, 5, 14])[torch.arange(g) % 4]  # padding: whole cp chunks
    mask = (torch.arange(SEQ)[None, :] < lengths[:, None]).long()
    labels = torch.where(torch.rand(g, SEQ, generator=gen) < 0.4, ids, torch.full_like(ids, -100))
    labels = labels.masked_fill(mask == 0, -100)
    types = (torch.arange(SEQ)[None, :] >= SEQ // 2).long().expand(g, SEQ)
    return {"input_ids": ids, "labels": labels, "attention_mask": mask,
            "token_type_ids": types.contiguous()}


def serial(kind: str, precision: str = "fp32", g: int = G, layers: int | None = None,
           loss_grads_in_forward: bool = True) -> dict:
    """Loss and full gradients of one process (cp 1, tp 1, pp 1) on the global batch (of `g`
    samples; `layers` transformer blocks instead of the config's); `loss_grads_in_forward`:
    the chunked loss's path (False: the backward recomputes the logits, as under GPipe)."""
    from megapar.optim import Precision

    model = build_stage(make_config(kind, layers), Mesh(Layout()), SEED)
    model.loss_grads_in_forward = loss_grads_in_forward
    micro = BatchPlan(g, MBS, 1).split(global_batch(kind, g), 0)
    total = 0.0
    with Precision(precision, torch.device("cpu")).autocast():
        for mb in micro:
            loss = model(None, mb)
            (loss / len(micro)).backward()
            total += loss.item() / len(micro)
    return {"loss": total, "grads": {n: unpad(p.grad, p.tp_dim, p.full_shape)
                                     for n, p in model.named_parameters()}}


def make_config(kind: str, layers: int | None = None):
    """The tiny config of `kind`, with `layers` blocks when given."""
    config = CONFIGS[kind]()
    if layers is not None:
        setattr(config, "n_layer" if kind == "gpt2" else "num_hidden_layers", layers)
    return config


def one_step(kind, tp, cp, pp, dp, schedule="1f1b", sp=False, recompute="none", v=1, zero=0,
             precision="fp32", method=None, g=G, layers=None, wire=None):
    """This rank's loss and the full gradients of its stage after one step's reduction
    (pipeline messages in `wire` precision, e.g. "bf16", if given; else in fp32)."""
    import torch.distributed as dist

    from megapar.data_parallel import build_grad_sync
    from megapar.optim import Precision, build_optimizer
    from megapar.optim.precision import PRECISIONS
    from megapar.pipeline.executor import PipelineExecutor
    from megapar.pipeline.schedules import placement_of
    from megapar.training.step import TrainStep

    mesh = Mesh(Layout(tp, pp, dp, cp=cp), dist.get_rank(), sequence_parallel=sp)
    model = build_stage(make_config(kind, layers), mesh, SEED, recompute, virtual_stages=v,
                        placement=placement_of(schedule))
    if method is not None:  # the other cp attention than the model's choice
        for module in model.modules():
            if getattr(module, "context_parallel", None) is not None:
                module.context_parallel.method = method
    seq = SEQ // cp // (tp if sp else 1)
    executor = PipelineExecutor(model, mesh, schedule, (MBS, seq, H), virtual_stages=v,
                                wire_dtype=None if wire is None else PRECISIONS[wire])
    optimizer = build_optimizer(model, mesh, 0.0, 0.0, zero=zero)
    grad_sync = build_grad_sync(model, mesh, zero, bucket_mb=0.01)
    step = TrainStep(model, mesh, executor, optimizer, None, Precision(precision, mesh.device),
                     0.0, grad_sync)
    grads = {}

    def record():  # the reduced gradients, as the optimizer sees them
        if getattr(optimizer, "sharded", False):
            gather_grads(optimizer)
        for name, p in model.named_parameters():
            grads[name] = gather_full(p.grad, p.tp_dim, p.full_shape, mesh.tp_group).clone()

    optimizer.step = record
    micro = BatchPlan(g, MBS, dp).split(global_batch(kind, g), mesh.dp_rank)
    result = step.step(to_device(micro, mesh.device), 0)
    return {"loss": result.loss, "grads": grads if mesh.tp_rank == 0 else {},
            "where": (mesh.cp_rank, mesh.pp_rank, mesh.dp_rank)}


def _worker(runs):
    return [one_step(*run[:5], **run[5]) for run in runs]


REFERENCES: dict = {}


def reference(kind: str, precision: str = "fp32", g: int = G, layers: int | None = None,
              loss_grads_in_forward: bool = True) -> dict:
    key = (kind, precision, g, layers, loss_grads_in_forward)
    if key not in REFERENCES:
        REFERENCES[key] = serial(*key)
    return REFERENCES[key]


def check(runs, outs, tol=1e-5):
    for i, run in enumerate(runs):
        kind, options = run[0], run[5]
        ref = reference(kind, options.get("precision", "fp32"), options.get("g", G),
                        options.get("layers"))
        what = f"{run[:5]} {options}"
        stages = set()
        for out in (o[i] for o in outs):
            assert_close(torch.tensor(out["loss"]), torch.tensor(ref["loss"]), tol,
                         f"{what} rank at {out['where']}: loss")
            for name, grad in out["grads"].items():  # every cp / dp rank: the same gradients
                tied = name == "head.weight" and kind not in ("llama", "mistral")
                source = "embed.word.weight" if tied else name
                assert_close(grad, ref["grads"][source], tol, f"{what} {out['where']} {name}")
            if out["grads"]:
                stages.add(out["where"][1])
                names = {n for o in outs if o[i]["where"][1] == out["where"][1]
                         for n in o[i]["grads"]}
                assert names == set(out["grads"])
        assert stages == set(range(run[3])), what
        covered = {n for o in outs for n in o[i]["grads"]}
        assert covered >= set(ref["grads"]) - {"head.weight"}, what


SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zb-v", 2)]
TWO = dict(layers=2)
"""2 blocks: one a stage at pp 2 (the schedules of one chunk a rank; interleaved and ZB-V
keep the config's 4 blocks for their 4 chunks), and the same code paths at pp 1 with half the
per-block collectives."""


@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert"])
def test_tp2_cp2_pp2_every_schedule_sp_and_recompute(kind):
    """tp 2 x cp 2 x pp 2: every schedule, without SP and recompute, then with SP and full
    recompute (selective with interleaved); Llama also with the ring instead of its all-gather.
    2 blocks (`TWO`) but under interleaved and ZB-V."""
    runs = []
    for schedule, v in SCHEDULES:
        blocks = TWO if v == 1 else {}
        runs.append((kind, 2, 2, 2, 1, dict(schedule=schedule, v=v, **blocks)))
        recompute = "selective" if schedule == "interleaved" else "full"
        runs.append((kind, 2, 2, 2, 1, dict(schedule=schedule, v=v, sp=True,
                                            recompute=recompute, **blocks)))
    if kind == "llama":
        runs.append((kind, 2, 2, 2, 1, dict(method="ring", sp=True, **TWO)))
        runs.append(("mistral", 2, 2, 2, 1, dict(method="ring", sp=True, **TWO)))  # its window
    check(runs, run_local(_worker, 8, runs))


@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert"])
def test_cp4_with_tp2_or_pp2(kind):
    """cp 4 x tp 2 (SP off / on with full recompute) and cp 4 x pp 2 (1F1B, interleaved); 2
    blocks (`TWO`) but under interleaved."""
    runs = [(kind, 2, 4, 1, 1, TWO), (kind, 2, 4, 1, 1, dict(sp=True, recompute="full", **TWO)),
            (kind, 1, 4, 2, 1, TWO), (kind, 1, 4, 2, 1, dict(schedule="interleaved", v=2))]
    check(runs, run_local(_worker, 8, runs))


def test_cp_alone_and_with_data_parallel_zero1():
    """cp 2 and cp 4 alone (Mistral's sliding window too); cp 2 x dp 2 with and without ZeRO-1
    (sharded over cp x dp). 2 blocks (`TWO`)."""
    runs = [(kind, 1, cp, 1, 1, TWO) for kind in ("gpt2", "llama", "mistral", "bert")
            for cp in (2, 4)]
    runs += [(kind, 1, 2, 1, 2, dict(zero=zero, **TWO)) for kind in ("gpt2", "bert")
             for zero in (0, 1)]
    outs = run_local(_worker, 4, [r for r in runs if r[2] * r[4] == 4])
    check([r for r in runs if r[2] * r[4] == 4], outs)
    runs2 = [r for r in runs if r[2] * r[4] == 2]
    check(runs2, run_local(_worker, 2, runs2))


def test_bf16_at_cp2_follows_bf16_at_cp1():
    """bf16 autocast composes: cp 2 x tp 2's loss lands within bf16's rounding of cp 1's, and
    its gradients are as close to cp 1's in bf16 as those are to fp32's (bf16's own rounding:
    the bound is twice that distance, each model's worst parameter; a cp attention that drops
    K/V blocks is 200 times it, where the loss at initialisation moves by 1e-4 only)."""
    runs = [(kind, 2, 2, 1, 1, dict(precision="bf16")) for kind in ("gpt2", "llama")]
    outs = run_local(_worker, 4, runs)
    for i, run in enumerate(runs):
        ref, fp32 = reference(run[0], "bf16"), reference(run[0], "fp32")
        rounding = max(rel_err(ref["grads"][n], fp32["grads"][n]) for n in ref["grads"])
        for out in (o[i] for o in outs):
            assert abs(out["loss"] - ref["loss"]) / ref["loss"] < 1e-3, (run, out["loss"],
                                                                        ref["loss"])
            for name, grad in out["grads"].items():
                tied = name == "head.weight" and run[0] != "llama"
                err = rel_err(grad, ref["grads"]["embed.word.weight" if tied else name])
                assert err < 2 * rounding, (run, name, err, rounding)
        assert any(out["grads"] for out in (o[i] for o in outs)), run


def _dropout_worker(comm="auto"):
    """GPT-2 at cp 2 with attention and residual dropout 0.1: recomputation (full, selective)
    replays the same masks, so its gradients equal those of no recomputation; and dropout
    changes the gradients. `comm`: --cp-comm-type."""
    import torch.distributed as dist

    from megapar.models import set_cp_comm

    out = {}
    for p, recompute in ((0.1, "none"), (0.1, "full"), (0.1, "selective"), (0.0, "none")):
        config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=H, n_layer=2, n_head=4,
                            resid_pdrop=p, embd_pdrop=p, attn_pdrop=p)
        mesh = Mesh(Layout(cp=2), dist.get_rank())
        model = build_stage(config, mesh, SEED, recompute)  # seeds the dropout streams
        set_cp_comm(model, comm)
        batch = BatchPlan(G, G, 1).split(global_batch("gpt2"), 0)[0]
        loss = model(None, batch)
        loss.backward()
        out[p, recompute] = (loss.item(), {n: q.grad.clone() for n, q in model.named_parameters()})
    return out


@pytest.mark.parametrize("comm", ["auto", "a2a"])
def test_attention_dropout_at_cp2_is_replayed_by_recomputation(comm):
    for out in run_local(_dropout_worker, 2, comm):
        loss, grads = out[0.1, "none"]
        for mode in ("full", "selective"):
            assert out[0.1, mode][0] == loss
            for name, grad in grads.items():
                assert_close(out[0.1, mode][1][name], grad, what=f"{mode} {name}")
        plain = out[0.0, "none"][1]
        assert max(rel_err(grads[n], plain[n]) for n in grads) > 1e-2


def test_a2a_alone_and_with_tp2_pp2_or_dp2_zero1():
    """--cp-comm-type a2a (the all-to-all, Ulysses) at cp 2: GPT-2, Llama (kv heads unexpanded:
    2 kv heads over cp 2), Mistral's sliding window and BERT's padding alone; GPT-2 and Llama
    at tp 2 (Llama's one kv head per tp rank replicated over cp; with SP and selective
    recompute), Llama at pp 2 (full recompute) and at dp 2 with ZeRO-1; GPT-2 and Llama (its 2 kv heads
    replicated over cp 4) at cp 4, one head a rank. 2 blocks (`TWO`)."""
    a2a = dict(method="a2a", **TWO)
    runs = [(kind, 1, 2, 1, 1, a2a) for kind in ("gpt2", "llama", "mistral", "bert")]
    check(runs, run_local(_worker, 2, runs))
    runs = [("gpt2", 2, 2, 1, 1, a2a),
            ("llama", 2, 2, 1, 1, dict(a2a, sp=True, recompute="selective")),
            ("llama", 1, 2, 2, 1, dict(a2a, recompute="full")),
            ("llama", 1, 2, 1, 2, dict(a2a, zero=1)),
            ("gpt2", 1, 4, 1, 1, a2a), ("llama", 1, 4, 1, 1, a2a)]
    check(runs, run_local(_worker, 4, runs))
