"""Each tensor-parallel layer against its plain torch reference on the full weights."""

import pytest
import torch
import torch.nn.functional as F
from tp_utils import assert_close, make_mesh

from megapar.launcher import run_local
from megapar.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    initialize,
    parallel_lm_logits,
    vocab_parallel_cross_entropy,
)
from megapar.tensor_parallel.init import param_seed
from megapar.tensor_parallel.partition import gather_full

SEED = 7
TPS = [1, 2, 4]


def _draw(name, shape, gen):
    return torch.empty(shape).normal_(0, 0.5, generator=gen)


def _full(name, shape):
    """The full tensor `initialize` draws for a parameter called `name`."""
    return _draw(name, shape, torch.Generator().manual_seed(param_seed(SEED, name)))


def _init(module):
    initialize(module, SEED, _draw, module._mesh.tp_rank)


def _grad_full(param, mesh):
    return gather_full(param.grad, param.tp_dim, param.full_shape, mesh.tp_group)


def _run(fn, tp):
    """fn(tp) on tp ranks (in this process when tp == 1); every rank's result."""
    return [fn(tp)] if tp == 1 else run_local(fn, tp, tp)


def _linear(kind, tp):
    """A column- (gather_output) or row-parallel (input not parallel) linear vs F.linear on the
    full weights: output, input gradient, and the full weight and bias gradients."""
    mesh = make_mesh(tp)
    if kind == "column":
        layer = ColumnParallelLinear(12, 8, mesh, gather_output=True)
    else:
        layer = RowParallelLinear(12, 8, mesh, input_is_parallel=False)
    layer._mesh = mesh
    _init(layer)
    w_ref = _full("weight", (8, 12)).requires_grad_()
    b_ref = _full("bias", (8,)).requires_grad_()
    x = torch.randn(3, 5, 12, generator=torch.Generator().manual_seed(1), requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    out, ref = layer(x), F.linear(x_ref, w_ref, b_ref)
    assert_close(out, ref, what=f"{kind} forward")
    grad_out = torch.randn(ref.shape, generator=torch.Generator().manual_seed(2))
    out.backward(grad_out)
    ref.backward(grad_out)
    assert_close(x.grad, x_ref.grad, what=f"{kind} input grad")
    assert_close(_grad_full(layer.weight, mesh), w_ref.grad, what=f"{kind} weight grad")
    assert_close(_grad_full(layer.bias, mesh), b_ref.grad, what=f"{kind} bias grad")
    return True


VOCAB = 37  # odd on purpose: not divisible by any tp, padded


def _embedding_and_loss(tp):
    """Embedding lookup, tied logits and vocab-parallel cross-entropy with ignore_index."""
    mesh = make_mesh(tp)
    emb = VocabParallelEmbedding(VOCAB, 6, mesh, divisible_by=4)
    emb._mesh = mesh
    _init(emb)
    w = _full("weight", (VOCAB, 6))
    w_ref = w.clone().requires_grad_()
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (4, 9), generator=gen)
    target = torch.randint(0, VOCAB, (4, 9), generator=gen)
    target[0, :3] = -100
    target[2, 5] = -100

    hidden = emb(ids) * 1.5
    ref_hidden = F.embedding(ids, w_ref) * 1.5
    assert_close(hidden, ref_hidden, what="embedding forward")
    logits = parallel_lm_logits(hidden, emb.weight, mesh)
    assert logits.shape[-1] == emb.local_vocab
    loss = vocab_parallel_cross_entropy(logits, target, mesh.tp_group, emb.vocab_start, VOCAB)
    ref_logits = F.linear(ref_hidden, w_ref)
    ref_loss = F.cross_entropy(ref_logits.transpose(1, 2), target, ignore_index=-100,
                               reduction="none")
    assert_close(loss, ref_loss, what="per-token loss")
    assert (loss[target == -100] == 0).all()
    loss.sum().backward()
    ref_loss.sum().backward()
    assert_close(_grad_full(emb.weight, mesh), w_ref.grad, what="embedding weight grad")
    if tp > 1:  # padding rows never receive gradient
        start = emb.vocab_start
        pad_rows = [i for i in range(emb.local_vocab) if start + i >= VOCAB]
        if pad_rows:
            assert (emb.weight.grad[pad_rows] == 0).all()
    return True


@pytest.mark.parametrize("kind", ["column", "row"])
@pytest.mark.parametrize("tp", TPS)
def test_parallel_linear(kind, tp):
    results = [_linear(kind, tp)] if tp == 1 else run_local(_linear, tp, kind, tp)
    assert all(results)


@pytest.mark.parametrize("tp", TPS)
def test_vocab_parallel_embedding_logits_and_cross_entropy(tp):
    assert all(_run(_embedding_and_loss, tp))


def _gpt2_sized_cross_entropy(tp):
    """A 50257-like odd vocabulary with Megatron's divisor 128."""
    mesh = make_mesh(tp)
    vocab = 50257
    from megapar.tensor_parallel.partition import local_size
    local = local_size(vocab, tp, 128)
    gen = torch.Generator().manual_seed(5)
    full_logits = torch.randn(2, 3, vocab, generator=gen)
    target = torch.randint(0, vocab, (2, 3), generator=gen)
    target[0, 0] = vocab - 1
    padded = torch.cat([full_logits, torch.full((2, 3, local * tp - vocab), 1e4)], dim=-1)
    shard = padded[..., mesh.tp_rank * local:(mesh.tp_rank + 1) * local].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(shard, target, mesh.tp_group, mesh.tp_rank * local, vocab)
    ref_in = full_logits.clone().requires_grad_()
    ref = F.cross_entropy(ref_in.transpose(1, 2), target, reduction="none")
    assert_close(loss, ref, what="loss with padded vocab")
    loss.sum().backward()
    ref.sum().backward()
    grad = gather_full(shard.grad, 2, (2, 3, vocab), mesh.tp_group)
    assert_close(grad, ref_in.grad, what="logit grads")
    return True


@pytest.mark.parametrize("tp", [2, 4])
def test_cross_entropy_gpt2_vocab(tp):
    assert all(run_local(_gpt2_sized_cross_entropy, tp, tp))


def test_bad_divisibility_is_named():
    from megapar.mesh import Layout, LayoutError, Mesh
    mesh = Mesh(Layout(1), 0)
    mesh.layout = Layout(3, 1, 1)  # pretend: only sizes matter for the check
    with pytest.raises(LayoutError, match="hidden size 100 is not divisible by --tp 3"):
        ColumnParallelLinear(100, 100, mesh, name="hidden size")
