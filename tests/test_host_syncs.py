"""No host-device synchronisation per micro-batch: a step's syncs do not grow with m.

On a GPU every `.item()`, `bool(tensor)`, boolean-mask index or host-to-device copy inside a
micro-batch makes the host wait for the device, which stalls the pipeline. `sync_count` wraps
those calls and watches the aten ops behind them (a tensor used as a size, `unique`, ...); a
training step at tp 2 x pp 2 (GPT-2, BERT, grouped-query Llama with one kv head, from
transformers configs, through `megapar.prepare`) makes the same number at 4 and at 8
micro-batches, and none of them is on the micro-batch path (models, tensor-parallel layers,
pipeline): only per-step work (checking the user's global batch, the gradient norm, the loss).
The same holds at cp 2 x pp 2, where every attention layer exchanges keys and values (with
Mistral's sliding window too), and for an fp16 step with --optimizer muon and PowerSGD, whose
overflow check reads one flag per step.
"""

import pytest
import torch
from sync_count import count_syncs

import megapar
from megapar.launcher import run_local

PER_MICRO_BATCH = ("models/", "tensor_parallel/", "pipeline/", "data_parallel/",
                   "context_parallel/", "expert_parallel/")


def config(kind, layers=2):
    from transformers import BertConfig, GPT2Config, LlamaConfig

    small = dict(vocab_size=96, bos_token_id=0, eos_token_id=0)
    if kind == "gpt2":
        return GPT2Config(n_embd=32, n_layer=layers, n_head=4, n_positions=32, **small)
    if kind == "mistral":  # a sliding window of 5 over 16 tokens (cp 2: chunks of 4)
        from transformers import MistralConfig

        return MistralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=4, sliding_window=5,
                             max_position_embeddings=32, **small)
    if kind == "llama":
        return LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=1,
                           max_position_embeddings=32, **small)
    return BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=64, max_position_embeddings=32, vocab_size=96)


def batch(kind, m):
    ids = torch.randint(0, 96, (m, 16), generator=torch.Generator().manual_seed(m))
    out = {"input_ids": ids, "labels": ids.clone()}
    if kind == "bert":
        out["labels"][:, ::2] = -100
        out.update(attention_mask=torch.ones_like(ids), token_type_ids=torch.zeros_like(ids))
    return out


def syncs_worker(kind, cp=1, schedule="1f1b", documents=None):
    layers = 4 if schedule in ("zb-v", "dualpipev") else 2  # the V: 2 pp chunks
    engine = megapar.prepare(config(kind, layers), tp=2 // cp, cp=cp, pp=2, micro_batch_size=1,
                             schedule=schedule, **(documents or {}))
    counts = {}
    for m in (4, 8):
        packed = batch(kind, m)
        if documents:  # documents of 5 tokens, each ended by the eod (id 0)
            packed["input_ids"][:, 4::5] = 0
        engine.train_step(packed)  # the first step of a shape builds its executor
        with count_syncs() as syncs:
            engine.train_step(packed)
        counts[m] = syncs
    return counts


DOCUMENTS = dict(attention_mask_type="block_causal", reset_position_ids=True, eod_mask_loss=True,
                 eod_id=0)


def test_packed_documents_add_no_host_sync():
    """block_causal with reset position ids and --eod-mask-loss: the documents' masks (Mistral's
    window ANDed with them; the ring's, per kernel call, from the documents of its queries' and
    keys' global positions) and rotary positions are made on the device per micro-batch, at
    cp 2 x pp 2 by the ring, with no host sync."""
    documents = {**DOCUMENTS, "cp_comm_type": "p2p"}
    for rank, counts in enumerate(run_local(syncs_worker, 4, "mistral", 2, "1f1b", documents)):
        assert counts[4] == counts[8], (rank, counts)
        assert 0 < sum(counts[8].values()) <= 8, (rank, counts[8])
        inside = [where for _, where in counts[8] if where.startswith(PER_MICRO_BATCH)]
        assert not inside, (rank, inside)


@pytest.mark.parametrize("kind,cp", [(kind, cp) for kind in ("gpt2", "bert", "llama")
                                     for cp in (1, 2)] + [("mistral", 2)])
def test_a_steps_host_syncs_do_not_grow_with_micro_batches(kind, cp):
    """tp 2 x pp 2, and cp 2 x pp 2 (ring attention for GPT-2 / BERT, all-gather for Llama);
    Mistral's sliding window of 5 at cp 2 x pp 2 too (the ring: the calls it cuts masked,
    those out of it left out)."""
    for rank, counts in enumerate(run_local(syncs_worker, 4, kind, cp)):
        assert counts[4] == counts[8], (rank, counts)
        assert 0 < sum(counts[8].values()) <= 8, (rank, counts[8])  # the loss at least
        inside = [where for _, where in counts[8] if where.startswith(PER_MICRO_BATCH)]
        assert not inside, (rank, inside)


@pytest.mark.parametrize("kind,schedule", [("gpt2", "zb-v"), ("llama", "dualpipev")])
def test_v_schedules_sync_no_more_per_micro_batch(kind, schedule):
    """tp 2 x pp 2 in the V: the in-memory turn, the loss and the tied sum on rank 0 add no
    per-micro-batch sync."""
    for rank, counts in enumerate(run_local(syncs_worker, 4, kind, 1, schedule)):
        assert counts[4] == counts[8], (rank, counts)
        assert 0 < sum(counts[8].values()) <= 8, (rank, counts[8])
        inside = [where for _, where in counts[8] if where.startswith(PER_MICRO_BATCH)]
        assert not inside, (rank, inside)


def test_the_counter_sees_what_a_micro_batch_path_would_do():
    """The counter is not blind: the calls the old code made per micro-batch are counted."""
    with count_syncs() as syncs:
        t = torch.arange(4.0)
        if (t > 2).any():  # `padding.any()` in the old vocab-parallel loss
            pass
        t[t > 1]  # a boolean mask
        torch.tensor([0, 1], device=t.device)  # the old grouped-query kv index, per call
        t.sum().item()
    assert sorted(call for call, _ in syncs) == [
        "__bool__", "item", "mask index", "torch.tensor(host data, device=...)"]


def test_the_counter_sees_the_syncs_torch_makes_in_cpp():
    """What no Python wrapper sees: a tensor as a size or a slice bound, a mask assignment,
    `torch.where(cond)`, `unique`, `bincount`, `equal` and `repeat_interleave` without its
    output size are counted by the aten op that waits; each once, and the same calls with
    their sizes given are not counted."""
    t, n = torch.arange(6.0), torch.tensor(3)
    repeats = torch.ones(6, dtype=torch.long)
    with count_syncs() as syncs:
        torch.zeros(n)
        t[:n]
        t[t > 4] = 0
        torch.where(t > 0)
        torch.unique(t)
        torch.bincount(repeats)
        torch.equal(t, t)
        torch.repeat_interleave(t, repeats)
    assert sorted(call for call, _ in syncs) == [
        "aten._local_scalar_dense", "aten._unique2", "aten.bincount", "aten.equal",
        "aten.nonzero", "mask assignment", "repeat_interleave without output_size"]
    assert syncs["aten._local_scalar_dense", "outside megapar"] == 2
    with count_syncs() as syncs:  # the sync-free spellings
        torch.zeros(3)
        t[:3]
        t.masked_fill_(t > 4, 0)
        torch.where(t > 0, t, 0.0)
        torch.repeat_interleave(t, repeats, output_size=6)
    assert not syncs, syncs


def zero3_syncs_worker(kind, precision="fp32", offload=False):
    if offload:  # host masters, as on CUDA
        import os

        from megapar.device import HOST_COPIES_ENV

        os.environ[HOST_COPIES_ENV] = "1"
    engine = megapar.prepare(config(kind), pp=2, micro_batch_size=1, zero=3,  # dp 2
                             precision=precision, offload_params=offload,
                             offload_optimizer=offload)
    counts = {}
    for m in (4, 8):
        engine.train_step(batch(kind, 2 * m))  # m micro-batches on each of the 2 dp ranks
        with count_syncs() as syncs:
            engine.train_step(batch(kind, 2 * m))
        counts[m] = syncs
    return counts


@pytest.mark.parametrize("precision,offload", [("fp32", False), ("bf16", False),
                                               ("bf16", True)])
def test_zero3_syncs_no_more_per_micro_batch(precision, offload):
    """pp 2 x dp 2 with --zero 3: gathering, freeing and reduce-scattering the units per
    micro-batch add no host sync (in bf16 with the blocks' linear weights gathered and read
    in 16 bits; under --offload-params too, their host masters copied up and rounded on the device)."""
    for rank, counts in enumerate(run_local(zero3_syncs_worker, 4, "gpt2", precision, offload)):
        assert counts[4] == counts[8], (rank, counts)
        assert 0 < sum(counts[8].values()) <= 8, (rank, counts[8])
        inside = [where for _, where in counts[8] if where.startswith(PER_MICRO_BATCH)]
        assert not inside, (rank, inside)


def zero12_syncs_worker(zero):
    """A bf16 ZeRO-`zero` step's syncs at 4 and 8 micro-batches (dp 2), and at 8 with the
    16-bit all-gather switched off (`optimizer.half`)."""
    engine = megapar.prepare(config("gpt2"), micro_batch_size=1, zero=zero, precision="bf16")
    engine.train_step(batch("gpt2", 8))
    counts = {}
    for m, half in ((4, True), (8, True), ("fp32 gathers", False)):
        engine.optimizer.half = engine.grad_sync.half if half else None
        with count_syncs() as syncs:
            engine.train_step(batch("gpt2", 2 * (8 if not half else m)))
        counts[m] = syncs
    return counts


@pytest.mark.parametrize("zero", [1, 2])
def test_zero12_16_bit_gathers_add_no_host_sync(zero):
    """dp 2 with --zero 1 / 2 in bf16, whose step all-gathers the blocks' linear weights in
    16 bits (`ZeroOptimizer._gather_half`): the syncs of the fp32 gathers' step, none per
    micro-batch."""
    for rank, counts in enumerate(run_local(zero12_syncs_worker, 2, zero)):
        assert counts[4] == counts[8] == counts["fp32 gathers"], (rank, counts)
        inside = [where for _, where in counts[8] if where.startswith(PER_MICRO_BATCH)]
        assert not inside, (rank, inside)


def muon_syncs_worker():
    """One ZeRO-1 step's syncs (dp 2, --optimizer muon) with every rank orthogonalising every
    matrix and with --muon-distributed (its all-to-alls' sizes and indices fixed at build)."""
    counts = {}
    for distributed in (False, True):
        engine = megapar.prepare(config("gpt2"), micro_batch_size=1, zero=1, optimizer="muon",
                                 muon_distributed=distributed)
        assert (engine.optimizer.muon_plan is not None) == distributed
        engine.train_step(batch("gpt2", 4))
        with count_syncs() as syncs:
            engine.train_step(batch("gpt2", 4))
        counts[distributed] = syncs
    return counts


def test_distributed_muon_adds_no_host_sync():
    """--muon-distributed's step (dp 2, ZeRO-1) makes the every-rank scheme's syncs (the
    gradient norm's), none in Muon's exchange: no sizes or owners are read from the device."""
    for rank, counts in enumerate(run_local(muon_syncs_worker, 2)):
        assert counts[True] == counts[False], (rank, counts)
        muon = [where for _, where in counts[True] if where.startswith(("optim/zero", "optim/mu"))]
        assert not muon, (rank, muon)


def fp16_syncs_worker():
    """An fp16 step's syncs (tp 2 x dp 2, --optimizer muon, PowerSGD, hysteresis 2) at 2 and
    4 micro-batches, and at a step whose gradients overflow; the schedule's position after
    each."""
    engine = megapar.prepare(config("gpt2"), tp=2, micro_batch_size=1, precision="fp16",
                             optimizer="muon", grad_compression="powersgd", hysteresis=2)
    counts, positions = {}, []
    for m in (2, 4, "overflow"):
        rows = 2 * (2 if m == "overflow" else m)
        if m == "overflow":  # hysteresis 2: the first overflow skips, the scale stays
            engine.precision.scaler.scale = 2.0**120
        else:  # the first step of a shape builds its executor
            engine.train_step(batch("gpt2", rows))
        with count_syncs() as syncs:
            engine.train_step(batch("gpt2", rows))
        counts[m] = syncs
        positions.append((engine.schedule_step, engine.step, engine.precision.loss_scale))
    return counts, positions


def test_fp16_muon_and_powersgd_add_no_host_sync():
    """fp16 loss scaling with hysteresis, Muon's tp and dp gathers and PowerSGD's fp32
    reduction: one sync for the overflow check per step (the flag all-reduced over the world
    first), none per micro-batch or per matrix; a step that overflows syncs no more (its norm
    is not read) and is skipped on every rank, the schedule not advancing."""
    for rank, (counts, positions) in enumerate(run_local(fp16_syncs_worker, 4)):
        assert counts[2] == counts[4], (rank, counts)
        inside = [where for _, where in counts[4] if where.startswith(PER_MICRO_BATCH)]
        assert not inside, (rank, inside)
        for m in (4, "overflow"):
            flags = [n for (_, where), n in counts[m].items() if where.startswith("optim/prec")]
            assert flags == [1], (rank, m, counts[m])
        assert set(counts["overflow"]) < set(counts[4]), (rank, counts)
        assert positions == [(2, 2, 2.0**16), (4, 4, 2.0**16), (4, 5, 2.0**120)], positions


def moe_syncs_worker():
    """A Mixtral step's syncs at pp 2 x ep 2 (one MoE layer a stage) at 4 and 8 micro-batches."""
    from transformers import MixtralConfig

    cfg = MixtralConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=4, num_local_experts=4,
                        num_experts_per_tok=2, max_position_embeddings=32, vocab_size=96,
                        bos_token_id=0, eos_token_id=0)
    engine = megapar.prepare(cfg, pp=2, ep=2, micro_batch_size=1)
    counts = {}
    for m in (4, 8):
        ids = torch.randint(0, 96, (2 * m, 16), generator=torch.Generator().manual_seed(m))
        step = {"input_ids": ids, "labels": ids.clone()}
        engine.train_step(step)  # the first step of a shape builds its executor
        with count_syncs() as syncs:
            engine.train_step(step)
        counts[m] = syncs
    return counts


def test_expert_parallel_syncs_once_per_moe_layer_and_micro_batch():
    """Under ep > 1 the token dispatch's all-to-all needs its split sizes on the host: one sync
    per MoE layer per micro-batch's forward (docs/architecture.md: "the one host sync"), the
    backward and recomputation reusing the kept route. A code reviewer's count (pp 2 x ep 2,
    one MoE layer a stage): 4 at 4 micro-batches, 8 at 8, nothing else growing with m; this
    holds it there, so a second per-micro-batch sync in the experts' path fails."""
    for rank, counts in enumerate(run_local(moe_syncs_worker, 4)):
        grew = counts[8] - counts[4]
        assert sum(grew.values()) == 4 and len(grew) == 1, (rank, counts)
        (call, where), = grew
        assert where.startswith("expert_parallel/dispatch.py"), (rank, call, where)
        assert counts[4][(call, where)] == 4, (rank, counts[4])
        # per step: the batch check, the norm, the loss, the router statistics' one read
        assert sum(counts[4].values()) - 4 <= 8, (rank, counts[4])
        stats = [n for (c, w), n in counts[4].items() if w.startswith("models/moe.py")]
        assert stats == [1], (rank, counts[4])  # was two: the loads, then the imbalance
