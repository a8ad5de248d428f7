"""The planner's process figure (`megapar.plan.process`) against what a process held.

On the GPU: the layouts measured on an H200 on 2026-11-26 (docs/performance.md, "On one GPU";
docs/performance-history.md, "On one GPU"), recomputed here with today's planner and compared
with the recorded allocator peaks and CUDA contexts. On the CPU: spawned ranks train two steps
and report how far their peak resident set rose (VmHWM, as tests/test_peak_memory.py measures
it), against the planner's figure for the same layout with `target="cpu"`.
"""

import sys

import pytest

from megapar.launcher import run_local
from megapar.models.recipes import resolve_model
from megapar.plan import Candidate, Problem, stage_memory
from megapar.plan.estimate import activation_sizes, stage_roles
from megapar.plan.process import describe, process_peak

GIB = 2**30

# (recipe, micro-batch, seq, allocated peak GiB, [reserved peak GiB, CUDA context GiB] per
# session): bf16 autocast, fp32 weights, AdamW, the whole logits (these ran before the chunked
# loss, issue 46), one GPU, 2026-11-26 at 95c0139 / d123c8b / 5c1d8ff.
H200 = [
    # tests/test_cuda_single.py::test_gpt2_124m_peak_memory_against_the_planner, two sessions
    # (docs/performance-history.md: "tensors 5.77 GiB ... 6.26-7.06 GiB reserved + 0.75 GiB
    # CUDA context"; commits 5c1d8ff and a5022d7)
    ("gpt2-124m", 4, 1024, 5.77, [(6.26, 0.75), (7.06, 0.75)]),
    # benchmarks/vs/gpu_bench.py (docs/performance.md's table: tensors' peak 16.5 / 48.4 GiB;
    # docs/performance-history.md: reserved 18.1 / 50.4 GiB "plus a 0.58 GiB CUDA context")
    ("gpt2-124m", 16, 1024, 16.5, [(18.1, 0.58)]),
    ("llama-1b", 4, 2048, 48.4, [(50.4, 0.58)]),
]


def _gpu_figure(recipe: str, mbs: int, seq: int):
    config = resolve_model(recipe)
    p = Problem(config, gpus=1, global_batch=mbs, seq_len=seq, precision="bf16",
                loss_chunk_tokens=0)
    c = Candidate(mbs=mbs)
    stage = stage_memory(p, c)[0]
    return process_peak(p, c, stage, *stage_roles(p, c, 0), activation_sizes(p, c).full)


@pytest.mark.parametrize("recipe,mbs,seq,allocated,sessions", H200,
                         ids=["gpt2-124m-4x1024", "gpt2-124m-16x1024", "llama-1b-4x2048"])
def test_gpu_figure_within_10_percent_of_the_h200(recipe, mbs, seq, allocated, sessions):
    """The tensors' peak within 10 % of the allocator's allocated peak, and the device figure
    (tensors, the allocator's reserve, the CUDA context) within 10 % of the reserved peak plus
    the context of every session. Before issue 47 the planner's figure was the tensors it
    counted: 4.60 GiB for the first layout, 1.25 x under its allocated peak."""
    peak = _gpu_figure(recipe, mbs, seq)
    assert peak.target == "gpu" and "H200" in describe(peak)
    assert peak.tensors / GIB == pytest.approx(allocated, rel=0.10)
    for reserved, context in sessions:
        assert peak.total / GIB == pytest.approx(reserved + context, rel=0.10)


def test_gpu_terms_name_what_the_h200_showed():
    """The terms the old figure lacked are there and sized: autocast's bf16 copies of GPT-2
    124M's weights (0.23 GiB, docs/performance-history.md), the log-softmax's gradient of the
    whole logits (4 x 1024 tokens x 50,257 x 4 bytes), the allocator's reserve and the
    context."""
    terms = {t.name: t.bytes for t in _gpu_figure("gpt2-124m", 4, 1024).terms}
    assert terms["autocast's 16-bit weight copies"] / GIB == pytest.approx(0.23, abs=0.01)
    assert terms["log-softmax's gradient"] == 4 * 1024 * 50257 * 4
    assert terms["CUDA context"] == 0.75 * GIB and terms["allocator's reserve"] > 0



@pytest.mark.parametrize("precision, master, why", [
    ("fp32", "fp32", "fp32 matmuls"),
    ("bf16", "separate", "16-bit weights: the matmuls use them as they are, nothing to cast")])
def test_no_autocast_copies_say_why(precision, master, why):
    """Without autocast copies the term says why: fp32 runs no 16-bit matmul; with separate
    master weights the matmuls are 16-bit but take the 16-bit weights themselves (it said
    "fp32 matmuls" there, of a bf16 plan)."""
    p = Problem(resolve_model("gpt2-tiny"), gpus=1, global_batch=4, seq_len=64,
                precision=precision, master_weights=master)
    c = Candidate(mbs=4)
    peak = process_peak(p, c, stage_memory(p, c)[0], *stage_roles(p, c, 0),
                        activation_sizes(p, c).full)
    term = next(t for t in peak.terms if t.name == "autocast's 16-bit weight copies")
    assert term.bytes == 0 and term.note == why

# -- the CPU ---------------------------------------------------------------------------------
CPU_LAYOUT = dict(n_embd=768, n_layer=6, n_head=12, vocab_size=50257)
"""GPT-2 124M's width and vocabulary with 6 blocks, 64 positions: 1.3 GiB of state and three
embedding-sized gradients at the end of the backward, so 10 % (about 0.18 GiB) is above the
run-to-run noise (0.14 GiB seen); one rank, one step of 64 tokens (14 s under a load of 11 on
2 cores, most of it building the model; 2 blocks would halve it, but their smaller peak
moves by as much as 10 % of it). Layouts whose
activations dominate are measured by benchmarks/memory/peak_memory.py (docs/guides/planner.md)."""


def _config(kwargs: dict, seq: int):
    from transformers import GPT2Config

    return GPT2Config(n_positions=max(seq, 64), resid_pdrop=0.0, embd_pdrop=0.0,
                      attn_pdrop=0.0, **kwargs)


def _rise(kwargs: dict, mbs: int, seq: int) -> int:
    """How far this rank's peak resident set rose over building its engine and a step (Adam's
    state is made with the engine: the first step is the peak), from a baseline with megapar's
    training modules and transformers' config imported (`plan.process.CPU_BASELINE`: as
    tests/test_peak_memory.py reads it; a baseline before them adds their ~107 MiB)."""
    import torch

    import megapar
    import megapar.training.prepare  # noqa: F401  in the baseline, as CPU_BASELINE counts it
    import torch._dynamo  # noqa: F401  too: building torch's optimizers imports it (70 MiB)

    def status(key: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))

    config = _config(kwargs, seq)  # transformers' config imported: in the baseline too
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak resident set starts again from the current one
    start = status("VmRSS")
    engine = megapar.prepare(config, micro_batch_size=mbs, seq_len=seq)
    vocab = kwargs["vocab_size"]
    ids = torch.randint(0, vocab, (mbs, seq + 1), generator=torch.Generator().manual_seed(0))
    engine.train_step({"input_ids": ids[:, :-1], "labels": ids[:, 1:]})
    return status("VmHWM") - start


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_cpu_figure_within_10_percent_of_the_os_peak():
    """The planner's CPU figure against a spawned rank's peak resident set rise (one run, up to
    two more where the lowest so far rose above the bound, the lowest taken: noise only adds to
    a peak, and once in a loaded suite run two did): within 10 % (issue 47). Until 2026-12-03
    about one spawned run in five rose 293 MiB more, by the clipping norm's holes in the heap
    (docs/performance.md, "At the peak the OS sees"), and one CI run had three. Measured
    2026-11-29 with the imports in the baseline (benchmarks/memory/planner_layouts.py
    gpt2-wide-one-process): 1,594 MiB against 1,663 predicted (+4.3 %): 1,534 MiB of tensors
    (the state and, at the end of the backward, two embedding-sized gradients: the head's,
    held, and the lookup's, added into it in place), the heap's room (0.2 x 295 MiB) and the
    runtime (70 MiB); 2026-12-01 1,591 MiB against 1,610 (+1.2 %: the room 0.1 x the
    transients in one process, the backward's parameter gradients among them, the runtime 30
    MiB). Before, three
    embedding-sized gradients and a 62 MiB runtime: 1,832 predicted, 12 % over on a quiet
    machine. The tensors counted before issue 47 (1.24 GiB) lacked the gradients at the end of
    the backward, the heap's room and the runtime: the figure under-predicted, the failure users
    met."""
    from megapar.models.config import config_from_dict

    mbs, seq = 1, 64
    config = config_from_dict(_config(CPU_LAYOUT, seq).to_dict())
    p = Problem(config, gpus=1, global_batch=mbs, seq_len=seq, precision="fp32", target="cpu")
    c = Candidate(mbs=mbs)
    stage = stage_memory(p, c)[0]
    peak = process_peak(p, c, stage, *stage_roles(p, c, 0), activation_sizes(p, c).full)
    assert peak.phase == "end of the backward"
    runs = [run_local(_rise, 1, CPU_LAYOUT, mbs, seq, start_method="spawn")[0]]
    while min(runs) * 0.9 > peak.total and len(runs) < 3:  # noise only adds to a peak: again,
        runs.append(run_local(_rise, 1, CPU_LAYOUT, mbs, seq, start_method="spawn")[0])
    measured = min(runs)  # the lowest run taken
    assert measured > 1.1 * stage.total, (measured / 2**20, stage.total / 2**20)
    assert abs(peak.total / measured - 1) <= 0.10, (peak.total / 2**20, runs)


def test_cpu_figure_keeps_sequence_parallelism_s_saving_and_grouped_copies_in_the_heap():
    """On a CPU the activations sequence parallelism splits stay in glibc's heap as holes, and
    with more than one sequence per micro-batch so do its reduce-scatters' grouped copies, one
    whole-sequence activation (s x b x h) for each of a block's two row-parallel layers
    (docs/guides/planner.md, "Sequence parallelism's heap": on tp 2, 8 blocks of hidden 256 at
    4 x 1,024 tokens the peak rose 46-72 MiB over tp 2's, at 1 x 4,096 -11 to +24): the CPU
    figure counts both as the term "sequence parallelism's holes"; the grouped copies are
    none at b = 1 and under full recomputation; the GPU figure and a plan without SP have no
    such term."""
    from megapar.models.config import config_from_dict

    wide = dict(n_embd=256, n_layer=8, n_head=8, vocab_size=1024)
    config = config_from_dict(_config(wide, 4096).to_dict())
    figures = {}
    for mbs, seq in ((4, 1024), (1, 4096)):
        p = Problem(config, gpus=2, global_batch=4, seq_len=seq, precision="fp32", target="cpu")
        for c in (Candidate(tp=2, mbs=mbs, sp=True), Candidate(tp=2, mbs=mbs),
                  Candidate(tp=2, mbs=mbs, sp=True, recompute="full")):
            stage = stage_memory(p, c)[0]
            for target in ("cpu", "gpu"):
                peak = process_peak(p, c, stage, *stage_roles(p, c, 0),
                                    activation_sizes(p, c).full, target)
                figures[mbs, c.sp, c.recompute, target] = (
                    stage, {t.name: t.bytes for t in peak.terms})
    holes = "sequence parallelism's holes"
    for mbs, seq in ((4, 1024), (1, 4096)):
        split, whole = figures[mbs, True, "none", "cpu"], figures[mbs, False, "none", "cpu"]
        saved = whole[0].activations - split[0].activations
        assert saved > 30 * 2**20, saved / 2**20
        copies = 2 * 8 * seq * mbs * 256 * 4 if mbs > 1 else 0  # 2 per block, s b h fp32
        assert split[0].sp_copies == copies, (mbs, split[0].sp_copies / 2**20)
        assert split[1][holes] == saved + copies, (mbs, split[1][holes] / 2**20)
        full = figures[mbs, True, "full", "cpu"]
        assert full[0].sp_copies == 0 and full[1].get(holes, 0) == full[0].sp_saved
        for key in ((mbs, True, "none", "gpu"), (mbs, False, "none", "cpu"),
                    (mbs, False, "none", "gpu")):
            assert holes not in figures[key][1], key


def test_cpu_figure_holds_the_embedding_gradients_second_place_after_the_first_steps():
    """At dp > 1 under ZeRO 0-2 a CPU rank's heap comes to hold the embedding's gradients a
    second time after its first steps (docs/guides/planner.md, "The heap after the first
    steps"): the CPU figure counts the end of the backward's embedding gradients again, as a
    term held only later, in `settled` and not in the figure (megapar-train's runs did not
    grow, docs/guides/planner.md); one process too, in its first step (BERT-base and GPT-2
    124M at 8 x 128 tokens rose 0.5-0.6 GiB over the figure there: a memory tryout); not at
    ZeRO-3 (its rank maps them apart), not on a GPU."""
    from megapar.models.config import config_from_dict
    from megapar.tensor_parallel.partition import local_size

    config = config_from_dict(_config(dict(n_embd=768, n_layer=2, n_head=12,
                                           vocab_size=50257), 64).to_dict())
    vocab = local_size(50257, 1, config.make_vocab_size_divisible_by)  # padded: 50,304

    def peak(dp: int, zero: int, target: str = "cpu"):
        p = Problem(config, gpus=dp, global_batch=dp, seq_len=64, precision="fp32",
                    target=target)
        c = Candidate(mbs=1, dp=dp, zero=zero)
        return process_peak(p, c, stage_memory(p, c)[0], *stage_roles(p, c, 0),
                            activation_sizes(p, c).full)

    name = "embedding gradients' second place in the heap"
    logits = 64 * vocab * 4  # the logits' second place (`test_cpu_figure_holds_the_logits...`)
    for dp, zero in ((2, 0), (2, 1), (2, 2), (1, 0)):
        terms = {t.name: t for t in peak(dp, zero).terms}
        grads = terms["embedding's weight gradient (end of the backward)"].bytes
        assert grads == 2 * vocab * 768 * 4 and terms[name].bytes == grads and terms[name].later
        assert peak(dp, zero).settled - peak(dp, zero).total == grads + logits
    for figure, later in ((peak(2, 3), 0), (peak(2, 2, "gpu"), 0)):
        assert name not in {t.name for t in figure.terms}
        assert figure.settled == figure.total + later


def test_cpu_figure_holds_the_logits_second_place_after_the_first_steps():
    """From the second step a CPU rank's heap can hold a micro-batch's logits twice (a new
    user's finding: llama-tiny in one process at 1 x 512 tokens rose 94-98 MiB at step 2, one
    logits' 98 MiB, and was 10-11 % over the figure from then on): a term in `settled`, not in
    the figure, of the micro-batch's fp32 logits over this rank's vocabulary, one chunk's with
    the chunked loss; none under ZeRO-3 (mapped apart), on a stage without the head, or on a
    GPU."""
    from megapar.models.config import config_from_dict
    from megapar.tensor_parallel.partition import local_size

    config = config_from_dict(_config(dict(n_embd=64, n_layer=2, n_head=4,
                                           vocab_size=50257), 512).to_dict())
    name = "logits' second place in the heap"

    def later(target="cpu", **kw):
        extra = {k: kw.pop(k) for k in ("loss_chunk_tokens",) if k in kw}
        gpus = kw.get("dp", 1) * kw.get("tp", 1) * kw.get("pp", 1)
        p = Problem(config, gpus=gpus, global_batch=kw.get("dp", 1) * kw.get("mbs", 1),
                    seq_len=512, precision="fp32", target=target, **extra)
        c = Candidate(**kw)
        peaks = [process_peak(p, c, stage_memory(p, c)[stage], *stage_roles(p, c, stage),
                              activation_sizes(p, c).full) for stage in range(c.pp)]
        return [next((t.bytes for t in pk.terms if t.name == name and t.later), 0.0)
                for pk in peaks]

    vocab = local_size(50257, 1, config.make_vocab_size_divisible_by)  # 50,304
    assert later(mbs=1) == [512 * vocab * 4]  # 98.25 MiB
    assert later(mbs=4) == [1024 * vocab * 4]  # a chunk of 1,024 (the default)
    assert later(mbs=1, loss_chunk_tokens=256) == [256 * vocab * 4]
    half = local_size(50257, 2, config.make_vocab_size_divisible_by)
    assert later(mbs=1, tp=2) == [512 * half * 4]
    assert later(mbs=1, pp=2) == [0.0, 512 * vocab * 4]  # the head's stage only
    assert later(mbs=1, dp=2, zero=3) == [0.0]
    assert later("gpu", mbs=1) == [0.0]


# -- autocast's copies ------------------------------------------------------------------------
def _zero3_casts(recipe: str, options: dict, zero: int = 3) -> dict:
    """One bf16 ZeRO-`zero` step of two micro-batches on this rank: {"cached": {parameter: bytes
    of its 16-bit casts still alive when the step's last backward ends (autocast's cache)},
    "casts": {parameter: casts made}, "sliced": the largest 16-bit cast of a parameter's slice
    (a per-use cast: the chunked loss's head), "sliced_alive": those alive at that end,
    "head_sliced": the largest slice cast of each of the head's parameters, summed}."""
    import weakref

    import torch
    import torch.distributed as dist
    from torch.utils._python_dispatch import TorchDispatchMode

    import megapar

    world = dist.get_world_size()
    engine = megapar.prepare(recipe, micro_batch_size=1, precision="bf16", zero=zero,
                             global_batch_size=2 * world, seq_len=32, **options)
    names = {id(p): n for n, p in engine.model.named_parameters()}
    seen: dict = {}
    experts = [0]

    class Casts(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            a = args[0] if args else None
            if func is torch.ops.aten._to_copy.default and out.dtype == torch.bfloat16:
                whole = names.get(id(a))
                part = a._base is not None and names.get(id(a._base))
                if whole or part:
                    key = whole or ("slice", part)
                    seen.setdefault(key, []).append((weakref.ref(out), out.nbytes))
                    if part and "experts" in part:  # routed experts' casts alive at once
                        experts[0] = max(experts[0], sum(
                            n for k, v in seen.items() if isinstance(k, tuple) and "experts" in k[1]
                            for r, n in v if r() is not None))
            return out

    alive: dict = {}
    sync = engine.grad_sync
    finish = sync.finish

    def at_finish(*args, **kwargs):  # the last backward is done; autocast has not exited
        alive.update({k: sum(n for r, n in v if r() is not None) for k, v in seen.items()})
        return finish(*args, **kwargs)

    sync.finish = at_finish
    ids = torch.randint(0, 1000, (2 * world, 33), generator=torch.Generator().manual_seed(0))
    with Casts():
        engine.train_step({"input_ids": ids[:, :-1], "labels": ids[:, 1:]})
    sliced = [k for k in seen if isinstance(k, tuple)]
    return {"cached": {k: alive[k] for k in seen if k not in sliced},
            "casts": {k: len(v) for k, v in seen.items() if k not in sliced},
            "sliced": max((n for k in sliced for _, n in seen[k]), default=0),
            "sliced_alive": sum(alive[k] for k in sliced),
            "experts_peak": experts[0],
            "head_sliced": sum(max(n for _, n in seen[k]) for k in sliced
                               if k[1] in ("head.weight", "head.bias", "embed.word.weight"))}


@pytest.mark.parametrize("recipe,options,what", [
    ("gpt2-tiny", {}, "column-parallel biases"),
    ("bert-tiny", {"loss_chunk_tokens": 0}, "the head's weight and bias, its transform"),
    ("mixtral-tiny", {}, "routers"),
    ("gpt2-tiny", {"offload_optimizer": True, "offload_params": True}, "column-parallel biases"),
])
def test_zero3_autocast_copies_are_the_casts_the_step_keeps(recipe, options, what,
                                                              monkeypatch):
    """Under ZeRO-3 in bf16 autocast caches a 16-bit copy of each parameter an op it runs in
    16 bits reads whole, kept to the step's end: the planner's term is the bytes of the casts
    still alive when a two-micro-batch step's last backward ends (each parameter cast once),
    on dp rank 0 of dp 2 (`what` each case keeps). The blocks' linear weights gathered in 16
    bits are read without a cast, under --offload-params too (host masters, as on CUDA: each
    copied up and rounded on the device). The chunked loss casts the head's real rows per use (freed when its
    backward ends): the top of the backward's "chunked loss's 16-bit cast" term. The planner
    counted no copy under ZeRO-3 (gpt2-tiny with both offloads: 396,800 bytes kept, 0
    planned); under --offload-params the gathers were fp32, and every linear weight's cast was
    kept (396,800 bytes, now the column-parallel biases' alone)."""
    from megapar.device import HOST_COPIES_ENV

    monkeypatch.setenv(HOST_COPIES_ENV, "1")
    config = resolve_model(recipe)
    measured = run_local(_zero3_casts, 2, recipe, options)[0]
    assert measured["cached"] and set(measured["casts"].values()) == {1}, measured["casts"]
    assert measured["sliced_alive"] == 0
    p = Problem(config, gpus=2, global_batch=4, seq_len=32, precision="bf16",
                **{k: v for k, v in options.items() if k == "loss_chunk_tokens"})
    c = Candidate(mbs=1, dp=2, zero=3, offload_optimizer=bool(options.get("offload_optimizer")),
                  offload_params=bool(options.get("offload_params")))
    peak = process_peak(p, c, stage_memory(p, c)[0], *stage_roles(p, c, 0),
                        activation_sizes(p, c).full)
    terms = {t.name: t.bytes for t in peak.terms}
    assert terms["autocast's 16-bit weight copies"] == sum(measured["cached"].values()), measured
    if options.get("offload_params"):  # the biases' casts (396,800 bytes with the weights')
        assert sum(measured["cached"].values()) == 3_584, measured
    cast = terms.get("the chunked loss's 16-bit cast of the head's weight", 0)
    assert cast == measured["sliced"] > 0 if p.loss_chunk_tokens else cast == 0, measured


@pytest.mark.parametrize("recipe,zero,chunk", [
    ("gpt2-tiny", 0, 1), ("gpt2-tiny", 1, 0), ("bert-tiny", 2, 1), ("bert-tiny", 0, 0),
    ("llama-tiny", 1, 1), ("llama-tiny", 2, 0), ("mixtral-tiny", 2, 1), ("mixtral-tiny", 1, 0),
])
def test_zero012_autocast_copies_are_the_casts_the_step_keeps(recipe, zero, chunk):
    """Under ZeRO 0-2 in bf16 the parameters stay fp32 (ZeRO-1 / 2 gather some in 16 bits,
    into fp32 buffers), so autocast casts every one an op it runs in 16 bits reads whole and
    keeps the cast to the step's end: the blocks' column- and row-parallel weights, the
    column-parallel biases, plain linears and routers, with the whole logits the head's weight
    and bias. Not norms (run in fp32), row-parallel biases (added after the reduction),
    embeddings and position embeddings (lookups), routed experts (sliced per use) nor, under
    the chunked loss, the head's weight: it casts the real rows per use (the top of the
    backward's "chunked loss's 16-bit cast", as under ZeRO-3). The planner's term is the
    bytes of the casts alive when a two-micro-batch step's last backward ends, on dp rank 0
    of dp 2, to the byte. It counted every parameter but a lookup-only embedding: gpt2-tiny
    chunked 6,855,424 bytes planned against 396,800 kept (the head's weight is 6,438,912).
    The routed experts' per-use casts are saved for each MoE layer's backward: the top of the
    backward's "routed experts' 16-bit casts" is the most of them alive at once (mixtral-tiny:
    393,216 bytes, every expert weight once)."""
    options = {} if chunk else {"loss_chunk_tokens": 0}
    measured = run_local(_zero3_casts, 2, recipe, options, zero)[0]
    assert measured["cached"] and set(measured["casts"].values()) == {1}, measured["casts"]
    assert measured["sliced_alive"] == 0
    p = Problem(resolve_model(recipe), gpus=2, global_batch=4, seq_len=32, precision="bf16",
                **options)
    c = Candidate(mbs=1, dp=2, zero=zero)
    peak = process_peak(p, c, stage_memory(p, c)[0], *stage_roles(p, c, 0),
                        activation_sizes(p, c).full)
    terms = {t.name: t.bytes for t in peak.terms}
    assert terms["autocast's 16-bit weight copies"] == sum(measured["cached"].values()), measured
    cast = terms.get("the chunked loss's 16-bit cast of the head's weight", 0)
    assert cast == measured["head_sliced"] > 0 if chunk else cast == 0, measured
    # the routed experts' per-use casts, saved for the backward: one micro-batch's at once
    routed = terms.get("routed experts' 16-bit casts", 0)
    assert routed == measured["experts_peak"] and (routed > 0) == (recipe == "mixtral-tiny")
