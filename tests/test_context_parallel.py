"""Context-parallel attention against torch's own attention on the whole sequence.

Each cp rank holds chunks r and 2cp - 1 - r of the sequence; ring attention and all-gather
attention must give, on those rows, exactly what `F.scaled_dot_product_attention` gives on the
whole sequence, and the same gradients for every query, key and value: causal (GPT-2 / Llama),
bidirectional with a padding mask (BERT), grouped-query heads, a sliding window (Mistral: the
blocks out of it left out, those it cuts masked), both kernels, cp 2 and 4.
The ring's exchanges are checked against NCCL's pairing rules.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megapar.context_parallel import (
    Ring,
    Spec,
    attention,
    chunk_ids,
    positions,
    split,
    unsplit,
)
from megapar.context_parallel.attention import plan
from megapar.launcher import run_local
from megapar.pipeline import nccl_rules


def test_split_positions_and_unsplit():
    x = torch.arange(16).view(1, 16)
    parts = [split(x, 4, r) for r in range(4)]
    assert parts[0].tolist() == [[0, 1, 14, 15]] and parts[3].tolist() == [[6, 7, 8, 9]]
    assert [positions(16, 4, r, "cpu").tolist() for r in range(4)] == [p[0].tolist()
                                                                       for p in parts]
    assert torch.equal(unsplit(parts), x)
    assert chunk_ids(4, 1) == (1, 6)
    with pytest.raises(ValueError, match="not divisible by 2 x cp = 8"):
        split(torch.zeros(1, 12), 4, 0)


@pytest.mark.parametrize("seq, cp, tp, sp, message", [
    (14, 2, 1, False, "sequence length 14 is not divisible by 2 x cp = 4 (context parallelism "
     "cuts each sequence into 2 x cp chunks); make it a multiple of 4"),
    # the per-cp-rank length once reached sequence parallelism's split in the forward:
    # "sequence length 10 is not divisible by --tp 3"
    (20, 2, 3, True, "sequence length 20 is not divisible by lcm(2 x cp, cp x tp) = 12 "
     "(context parallelism cuts each sequence into 2 x cp = 4 chunks and sequence parallelism "
     "cuts each cp rank's tokens into tp slices); make it a multiple of 12"),
    (21, 1, 2, True, "sequence length 21 is not divisible by tp = 2"),
    (20, 2, 3, False, None),
    (24, 2, 3, True, None),
    (21, 1, 2, False, None),
])
def test_the_engine_checks_a_batch_against_cp_and_sequence_parallelism(seq, cp, tp, sp, message,
                                                                        monkeypatch):
    """`megapar.prepare`'s engine refuses a batch whose sequences the cp split and sequence
    parallelism cannot cut, naming the whole length, before anything is communicated."""
    from types import SimpleNamespace

    from megapar.training import engine as engine_module
    from megapar.training.engine import Engine

    class Compared(Exception):
        """The batch passed its local checks and reached the comparison over the ranks."""

    def compare(*args):
        raise Compared

    monkeypatch.setattr(engine_module, "same_call_on_every_rank", compare)
    mesh = SimpleNamespace(cp=cp, tp=tp, sequence_parallel=sp, device="cpu")
    engine = SimpleNamespace(mesh=mesh, loss_fn=None, step=0, config=SimpleNamespace(
        model_type="llama", max_positions=64, vocab_size=100))
    ids = torch.zeros(2, seq, dtype=torch.long)
    batch = {"input_ids": ids, "labels": ids}  # eval_step needs labels as train_step does
    if message is None:
        with pytest.raises(Compared):
            Engine._checked(engine, batch, "eval_step")
        return
    with pytest.raises(ValueError) as exc:
        Engine._checked(engine, batch, "eval_step")
    assert str(exc.value).startswith(message), exc.value


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_causal_work_is_the_same_on_every_rank(cp):
    """Megatron's load balancing: every rank scores the same number of (query, key) pairs."""
    c = 4
    work = []
    for rank in range(cp):
        pairs = 0
        for source in range(cp):
            for call in plan(cp, rank, source, c, causal=True):
                rows, cols = call.q.stop - call.q.start, call.kv.stop - call.kv.start
                pairs += rows * (rows + 1) // 2 if call.causal else rows * cols
        work.append(pairs)
    s = 2 * cp * c
    assert work == [s * (s + 1) // 2 // cp] * cp


CASES = [(method, causal, masked, kernel, gqa, None)
         for method in ("ring", "all-gather") for causal, masked in ((True, False), (False, True))
         for kernel in ("flash", "math") for gqa in (False, True)]
CASES += [  # sliding windows (Mistral's) over chunks of 4: of 5 keys (blocks out of it left
    # out, blocks it cuts masked) and of 3 (it cuts each chunk's own block too)
    ("ring", True, False, "flash", True, 5), ("ring", True, False, "math", True, 3),
    ("all-gather", True, False, "flash", True, 3), ("all-gather", True, False, "math", True, 5)]


def _gather_seq(t, cp, group):
    parts = [torch.empty_like(t) for _ in range(cp)]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    return unsplit(parts, dim=2)


def _attention_worker(cp):
    rank, group = dist.get_rank(), dist.new_group(list(range(cp)))
    ring = Ring(group, 60)
    errors = {}
    for method, causal, masked, kernel, gqa, window in CASES:
        torch.manual_seed(0)
        b, h, s, d = 2, 4, (8 if window else 4) * cp, 8
        hkv = 2 if gqa else h
        q, do = torch.randn(b, h, s, d), torch.randn(b, h, s, d)
        k, v = torch.randn(b, hkv, s, d), torch.randn(b, hkv, s, d)
        mask = None
        if masked:  # padding at the end; one block of the second sequence is all padding
            mask = torch.ones(b, s, dtype=torch.bool)
            mask[0, s - 3:] = False
            mask[1, 3:] = False
        index = torch.arange(h) // (h // hkv) if gqa else None
        ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
        rk, rv = ref_in[1:]
        if gqa:
            rk, rv = rk.index_select(1, index), rv.index_select(1, index)
        full_mask = None if mask is None else mask[:, None, None, :]
        if window is not None:  # key > query - window, key <= query
            pos = torch.arange(s)
            full_mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
        ref = F.scaled_dot_product_attention(ref_in[0], rk, rv, attn_mask=full_mask,
                                             is_causal=causal and window is None)
        ref.backward(do)
        local = [split(t, cp, rank, dim=2).clone().requires_grad_() for t in (q, k, v)]
        spec = Spec(cp, rank, causal, ring if method == "ring" else group, kernel=kernel,
                    window=window)
        out = attention(*local, spec, mask, index, method)
        out.backward(split(do, cp, rank, dim=2))
        got = [_gather_seq(t, cp, group) for t in (out, *(x.grad for x in local))]
        want = [ref, *(x.grad for x in ref_in)]
        errors[method, causal, masked, kernel, gqa, window] = [
            ((a - w).abs().max() / w.abs().max()).item() for a, w in zip(got, want)]
    return errors


@pytest.mark.parametrize("cp", [2, 4])
def test_cp_attention_equals_attention_on_the_whole_sequence(cp):
    for case, errs in run_local(_attention_worker, cp, cp)[0].items():
        assert max(errs) < 1e-5, (cp, case, errs)  # out, dq, dk, dv


def _dropout_worker(cp, method):
    """Attention dropout: the cp result and gradients equal the whole sequence's attention with
    the very masks the blocks drew (read back by replaying their RNG states)."""
    rank, group = dist.get_rank(), dist.new_group(list(range(cp)))
    torch.manual_seed(1)
    b, h, s, d = 1, 2, 4 * cp, 4
    q, k, v, do = (torch.randn(b, h, s, d) for _ in range(4))
    local = [split(t, cp, rank, dim=2).requires_grad_() for t in (q, k, v)]
    spec = Spec(cp, rank, True, Ring(group, 60) if method == "ring" else group, dropout_p=0.3)
    out = attention(*local, spec, method=method)
    out.backward(split(do, cp, rank, dim=2))
    masks = out.grad_fn.spec.masks
    keep = torch.ones(b, h, 2 * s // (2 * cp), s)  # this rank's rows, global key columns
    with masks.replaying():
        order = range(cp) if method == "all-gather" else [(rank - i) % cp for i in range(cp)]
        for source in order:
            cols = positions(s, cp, source, "cpu")
            for call in plan(cp, rank, source, s // (2 * cp), True):
                keep[:, :, call.q][..., cols[call.kv]] = masks.draw(
                    (b, h, call.q.stop - call.q.start, call.kv.stop - call.kv.start))
    full_keep = _gather_seq(keep, cp, group)
    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    scores = ref_in[0] @ ref_in[1].transpose(-1, -2) / d ** 0.5
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    ref = (scores.softmax(-1) * full_keep) @ ref_in[2]
    ref.backward(do)
    got = [_gather_seq(t, cp, group) for t in (out, *(x.grad for x in local))]
    errs = [((a - w).abs().max() / w.abs().max()).item()
            for a, w in zip(got, [ref, *(x.grad for x in ref_in)])]
    dropped = (full_keep == 0).float().mean().item()
    return errs, dropped


@pytest.mark.parametrize("method", ["ring", "all-gather"])
def test_attention_dropout_backward_replays_the_forward_masks(method):
    for errs, dropped in run_local(_dropout_worker, 2, 2, method):
        assert max(errs) < 1e-5, errs
        assert 0.1 < dropped < 0.5  # p = 0.3 of the probabilities (and their gradients) dropped


def _ring_record_worker(cp):
    """(rank, the ring's exchanges of one attention's forward and backward, those of the same
    with a sliding window of 3 over chunks of 2, which leaves out and masks kernel calls)."""
    rank, group = dist.get_rank(), dist.new_group(list(range(cp)))
    q, k, v = (split(torch.randn(1, 2, 4 * cp, 4), cp, rank, dim=2).requires_grad_()
               for _ in range(3))
    issued = []
    for window in (None, 3):
        ring = Ring(group, 60)
        ring.issued = []
        spec = Spec(cp, rank, True, ring, label="layer 0", window=window)
        attention(q, k, v, spec, method="ring").sum().backward()
        issued.append(ring.issued)
    return rank, issued[0], issued[1]


def _streams(records) -> dict:
    """Each exchange as one NCCL group [send to next, receive from previous]."""
    return {rank: [[nccl_rules.Op(True, nxt, label, label, 4 * n),
                    nccl_rules.Op(False, prev, label, label, 4 * n)]
                   for nxt, prev, n, label in issued] for rank, issued in records}


@pytest.mark.parametrize("cp", [2, 4])
def test_ring_exchanges_pair_in_order_under_nccl_rules(cp):
    """Forward: cp - 1 K/V exchanges; backward: cp - 1 K/V and cp dK/dV exchanges. Grouped,
    they neither deadlock nor mismatch under NCCL's rules; issued one message at a time (each
    rank's send first), the ring deadlocks. A sliding window issues the same exchanges."""
    records = run_local(_ring_record_worker, cp, cp)
    assert all(issued == windowed for _, issued, windowed in records)
    records = [(rank, issued) for rank, issued, _ in records]
    for _, issued in records:
        labels = [label for *_, label in issued]
        assert len(labels) == (cp - 1) + (cp - 1) + cp
        assert labels[:cp - 1] == [f"layer 0: K/V step {i + 1}" for i in range(cp - 1)]
    streams = _streams(records)
    nccl_rules.check(streams)
    with pytest.raises(nccl_rules.DeadlockError):
        nccl_rules.check({r: [[op] for g in s for op in g] for r, s in streams.items()})


def _step_record_worker(schedule, v, recompute):
    """One training step of GPT-2 at cp 2 x pp 2: every point-to-point group this rank issues
    (the pipeline's and the cp ring's), in issue order."""
    from megapar.mesh import Layout, Mesh
    from megapar.models import GPT2Config
    from megapar.pipeline.executor import PipelineExecutor
    from megapar.pipeline.partition import build_stage

    mesh = Mesh(Layout(1, 2, 1, cp=2), dist.get_rank())
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=4, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = build_stage(config, mesh, 0, recompute, virtual_stages=v)
    executor = PipelineExecutor(model, mesh, schedule, (1, 8, 16), virtual_stages=v)
    executor.post_ahead = False  # issue receives where the program has them, as on NCCL
    gen = torch.Generator().manual_seed(0)
    batches = [{"input_ids": (x := torch.randint(0, 64, (1, 16), generator=gen)),
                "labels": x} for _ in range(4)]
    groups, original = [], dist.batch_isend_irecv

    def record(ops):
        groups.append([nccl_rules.Op(
            op.op is dist.isend, op.peer,
            ("cp" if op.group is mesh.cp_group else "pp", op.tensor.numel()),
            f"{'S' if op.op is dist.isend else 'R'}-{'cp' if op.group is mesh.cp_group else 'pp'}"
            f"@{dist.get_rank()}", op.tensor.numel() * op.tensor.element_size()) for op in ops])
        return original(ops)

    dist.batch_isend_irecv = record
    try:
        executor.run(batches)
    finally:
        dist.batch_isend_irecv = original
    return dist.get_rank(), groups


@pytest.mark.parametrize("schedule,v,recompute", [("1f1b", 1, "full"), ("interleaved", 2, "none"),
                                                  ("zb-h1", 1, "none"), ("gpipe", 1, "none")])
def test_pipeline_and_cp_ring_messages_of_real_steps_follow_nccl_rules(schedule, v, recompute):
    """The ring's exchanges interleaved with the pipeline's messages, as one ordered stream per
    rank (stricter than NCCL, where the two groups are separate communicators): paired in
    order, no deadlock under zero buffering."""
    streams = dict(run_local(_step_record_worker, 4, schedule, v, recompute))
    kinds = {op.message[0] for s in streams.values() for g in s for op in g}
    assert kinds == {"cp", "pp"}
    nccl_rules.check(streams)
