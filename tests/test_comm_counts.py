"""Communication is counted, not guessed: the collectives of one training step at tp 2 and 4.

Megatron's minimum for tensor parallelism, per transformer layer and micro-batch of b x s
tokens: 2 all-reduces of b x s x h in forward (after attention's and the MLP's row-parallel
projections) and 2 in backward (the input gradients of the fused QKV and of the MLP's first
column-parallel projection). Plus, per micro-batch, the vocab-parallel embedding's forward
all-reduce and the LM head's backward one (b x s x h each) and the vocab-parallel
cross-entropy's 3 all-reduces of b x s (max, target logit, sum of exponentials); per step, one
scalar all-reduce of the squared gradient norm. Nothing else crosses the tp group.
"""

from collections import Counter

import pytest
import torch

from comm_count import count_collectives, summary
from megapar.launcher import run_local
from megapar.mesh import Layout, Mesh
from megapar.models import BertConfig, GPT2Config
from megapar.training.build import build_stage

L, H, MBS, SEQ, M, VOCAB = 3, 32, 2, 8, 2, 96
CONFIGS = {
    "gpt2": dict(vocab_size=VOCAB, n_positions=SEQ, n_embd=H, n_layer=L, n_head=4,
                 make_vocab_size_divisible_by=8, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "bert": dict(vocab_size=VOCAB, hidden_size=H, num_hidden_layers=L, num_attention_heads=4,
                 intermediate_size=2 * H, max_position_embeddings=SEQ,
                 make_vocab_size_divisible_by=8, hidden_dropout_prob=0.0,
                 attention_probs_dropout_prob=0.0),
}


def micro_batches(kind: str) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for _ in range(M):
        ids = torch.randint(0, VOCAB, (MBS, SEQ), generator=gen)
        batch = {"input_ids": ids, "labels": (ids + 1) % VOCAB}
        if kind == "bert":
            batch["attention_mask"] = torch.ones_like(ids)
        out.append(batch)
    return out


def make_step(kind: str, mesh: Mesh, recompute: str = "none", overrides: dict | None = None,
              **step_kwargs):
    from megapar.optim import LRScheduler, Precision, build_optimizer
    from megapar.pipeline.executor import PipelineExecutor
    from megapar.training.step import TrainStep

    config = (GPT2Config if kind == "gpt2" else BertConfig)(**{**CONFIGS[kind], **(overrides or {})})
    model = build_stage(config, mesh, seed=0, recompute=recompute)
    seq = SEQ // mesh.tp if mesh.sequence_parallel else SEQ
    executor = PipelineExecutor(model, mesh, "1f1b", (MBS, seq, H))
    optimizer = build_optimizer(model, mesh, 1e-3, 0.1)
    return TrainStep(model, mesh, executor, optimizer, LRScheduler(1e-3, 1e-4, 0, 10, "constant"),
                     Precision("fp32", mesh.device), 1.0, **step_kwargs)


def _worker(kind: str, tp: int, sequence_parallel: bool = False):
    import torch.distributed as dist

    mesh = Mesh(Layout(tp, 1, 1), dist.get_rank())
    mesh.sequence_parallel = sequence_parallel
    step = make_step(kind, mesh)
    step.step(micro_batches(kind), 0)  # warm-up
    with count_collectives() as calls:
        step.step(micro_batches(kind), 1)
    return calls


def expected_tp_step(tp: int) -> Counter:
    bsh, bs = MBS * SEQ * H, MBS * SEQ
    per_micro_batch = 2 * L + 2 * L + 1 + 1   # layers fwd + bwd, embedding fwd, head bwd
    return Counter({("all_reduce", bsh, tp): M * per_micro_batch,
                    ("all_reduce", bs, tp): M * 3,    # vocab-parallel cross-entropy
                    ("all_reduce", 1, tp): 1})        # global gradient norm


@pytest.mark.parametrize("kind", ["gpt2", "bert"])
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_step_does_megatrons_minimum_all_reduces(kind, tp):
    for rank_calls in run_local(_worker, tp, kind, tp):
        assert summary(rank_calls) == expected_tp_step(tp)
        assert all(c.dtype == torch.float32 and c.bytes == 4 * c.numel for c in rank_calls)


def expected_sp_step(kind: str, tp: int) -> Counter:
    """Sequence parallelism: each all-reduce of b x s x h becomes an all-gather of the b x s/tp
    x h slices and a reduce-scatter of b x s x h (the same bytes on the wire), at the same
    places; the embedding's forward all-reduce stays (its output is then split, no traffic;
    the backward all-gathers the gradient); the LM head gathers its input. Plus one all-reduce,
    per step, of the replicated parameters' partial gradients (LayerNorms, row-parallel biases,
    BERT's head transform)."""
    bsh, bs, h = MBS * SEQ * H, MBS * SEQ, H
    gathers = 2 * L + 2 * L + 1 + 1     # layers fwd + bwd, head fwd, embedding bwd
    scatters = 2 * L + 2 * L + 1        # layers fwd + bwd, head bwd
    replicated = L * 6 * h + (2 * h if kind == "gpt2" else h * h + 3 * h)
    return Counter({("all_gather_single", bsh // tp, tp): M * gathers,
                    ("reduce_scatter_single", bsh, tp): M * scatters,
                    ("all_reduce", bsh, tp): M,        # vocab-parallel embedding
                    ("all_reduce", bs, tp): M * 3,
                    ("all_reduce", replicated, tp): 1,
                    ("all_reduce", 1, tp): 1})


@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_sequence_parallel_step_collectives(kind):
    tp = 2
    for rank_calls in run_local(_worker, tp, kind, tp, True):
        assert summary(rank_calls) == expected_sp_step(kind, tp)
