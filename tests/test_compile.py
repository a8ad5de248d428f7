"""`--compile` (torch.compile per transformer block) against eager, in forked worlds.

A tiny GPT-2 (test_api's transformers model), a tiny grouped-query Llama and a tiny Mixtral
(the Llama's attention, a mixture-of-experts MLP) run through `megapar.prepare` twice each,
eager and then with `compile=True`, five steps each, in four layouts: three in one world of
four gloo ranks, one in a world of one process:

- GPT-2, tp 2 x pp 2, 1F1B, sequence parallelism, selective recomputation;
- Llama, tp 2 x pp 2, ZB-H1 (the split backward: B's input gradients, W's deferred weight
  gradients);
- Mixtral, cp 2 x dp 2 x ep 2, ZeRO-3 (gather and free per block through hooks on the blocks,
  the experts a unit of their own over the expert-data-parallel group), full recomputation
  (the MoE layer's kept routes replayed in the recompute): the routed experts run eagerly
  (their rows per expert are data-dependent shapes), so the router's top-k counts change
  every micro-batch without recompiling;
- GPT-2, one process, full recomputation (the whole block one graph, checkpointed from
  outside).

So both models run compiled at tp 2 x pp 2, but each under one of the two schedules (GPT-2
under 1F1B, Llama under ZB-H1), and dp 2 / ZeRO-3 / cp 2 / ep 2 only for Mixtral;
`benchmarks/vs/compile_layouts.py` runs every one of these layouts for both models, and the
layouts no test compiles (docs/guides/training.md "Compiling the blocks").

The compiled run must equal the eager one (fp32: every step's loss and the final weights within
1e-5 relative); dynamo must compile nothing after the first step (its frame, graph and
aot_autograd counters unchanged from step 1 to step 5); and every graph break dynamo records
must be one docs/guides/training.md lists for its layout (at tp > 1 the tp collectives, under
ZB-H1 the deferring linears, at cp > 1 the attention's exchanges, in a MoE layer its routed
experts: all marked `megapar.graph_break` on purpose; in one process of a dense model none).

The one-process GPT-2 compiles with Inductor, megapar's backend (torch.compile's default), so
Inductor's generated kernels are held to eager here. The three four-rank layouts compile with
torch's "aot_eager" backend: dynamo and AOTAutograd as with Inductor (the same frames, graphs,
graph breaks and recompiles, the same joint forward / backward graphs and partition, so the
hooks, the tp collectives, the deferred linears and ZeRO-3 around them are exercised as
compiled), but the partitioned graphs run as eager ATen calls instead of Inductor's C++ kernels,
whose cold compile is most of what four ranks on two cores would spend here.
`benchmarks/vs/compile_layouts.py` runs every layout under Inductor.
"""

import functools
import importlib.util

import pytest
import torch
from test_api import _batches, _hf_model
from tp_utils import assert_close

from megapar.launcher import run_local

STEPS = 5
# Inductor fuses the block's operations, so its gradients carry other fp32 rounding (~1e-7 of
# the largest entry); with Adam's usual eps (1e-8) entries whose gradient is that noise (the
# attention key bias: zero in exact arithmetic) take ~lr-sized steps of random sign. eps 1e-4
# keeps such updates proportional to the gradient, as test_parity_3d.py explains for tp.
ADAM_EPS = 1e-4
LAYOUTS = {
    "gpt2 tp2 x pp2 1f1b sp selective": dict(tp=2, pp=2, schedule="1f1b",
                                             sequence_parallel=True, recompute="selective"),
    "llama tp2 x pp2 zb-h1": dict(tp=2, pp=2, schedule="zb-h1"),
    "mixtral cp2 x dp2 ep2 zero3 full": dict(cp=2, ep=2, zero=3, recompute="full"),
}
ONE_PROCESS = {"gpt2 one process full": dict(recompute="full")}
# torch.compile's backend per world (the module docstring says why)
LAYOUTS_BACKEND, ONE_PROCESS_BACKEND = "aot_eager", "inductor"
# What the compiled blocks leave eager on purpose, per layout (the functions' names appear in
# dynamo's graph-break reasons): the tp region primitives, the zero-bubble deferring linear,
# context parallelism's attention exchanges, the MoE layer's routed experts. Each layout must
# show exactly its own.
EXPECTED_BREAKS = {
    "gpt2 tp2 x pp2 1f1b sp selective": {"_apply_eagerly"},
    "llama tp2 x pp2 zb-h1": {"_apply_eagerly", "_deferred_linear"},
    "mixtral cp2 x dp2 ep2 zero3 full": {"LayerAttention._eager", "MoE._routed_eagerly"},
    "gpt2 one process full": set(),
}


def _counts():
    from torch._dynamo.utils import counters

    return (counters["frames"]["total"], counters["frames"]["ok"],
            counters["stats"]["unique_graphs"], counters["aot_autograd"]["total"])


def _breaks() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return dict(counters["graph_break"])


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    return LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, max_position_embeddings=16))


def _mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(3)
    return MixtralForCausalLM(MixtralConfig(vocab_size=96, hidden_size=32, intermediate_size=32,
                                            num_hidden_layers=2, num_attention_heads=4,
                                            num_key_value_heads=2, max_position_embeddings=16,
                                            num_local_experts=4, num_experts_per_tok=2,
                                            router_aux_loss_coef=0.02))


MODELS = {"gpt2": _hf_model, "llama": _llama, "mixtral": _mixtral}


def _run(name: str, layout: dict, compile: bool):
    import megapar

    model = MODELS[name.split()[0]]()
    engine = megapar.prepare(model, micro_batch_size=2, lr=3e-3, weight_decay=0.1,
                             clip_grad=0.5, adam_eps=ADAM_EPS, compile=compile, **layout)
    losses, counts = [], []
    for batch in _batches(STEPS):
        losses.append(engine.train_step(batch))
        counts.append(_counts())
    with engine.params_whole():
        weights = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    return losses, weights, counts


def _worker(layouts: dict, backend: str):
    import torch._dynamo
    import torch._inductor.config

    torch._inductor.config.compile_threads = 1  # 4 ranks on few cores: no compile workers
    # Inductor's vector instruction sets are the CPU's (its flags), without first building and
    # loading a test program for each (its once-per-machine probes of AVX2, AVX512, VNNI: a
    # C++ build each, 10 s of a cold cache's run); a compiler that cannot build for one fails
    # the kernels' build here instead
    torch._inductor.config.cpp.vec_isa_ok = True
    torch._dynamo.reset()
    # megapar.models.compile calls torch.compile(block.forward): give it this world's backend
    # (a forked worker: the patch ends with it), and count the calls that took it
    compiled_with = []

    def compile_with_backend(fn, *, _compile=torch.compile, **kwargs):
        compiled_with.append(backend)
        return _compile(fn, backend=backend, **kwargs)

    torch.compile = compile_with_backend
    out = {}
    for name, layout in layouts.items():
        before_breaks, before = _breaks(), _counts()
        eager_losses, eager_weights, _ = _run(name, layout, False)
        assert _counts() == before, f"{name}: the eager run compiled something"
        losses, weights, counts = _run(name, layout, True)
        new_breaks = {k: v - before_breaks.get(k, 0) for k, v in _breaks().items()
                      if v > before_breaks.get(k, 0)}
        for a, b in zip(losses, eager_losses):
            assert_close(torch.tensor(a), torch.tensor(b), 1e-5, f"{name}: loss")
        for n, w in weights.items():
            assert_close(w, eager_weights[n], 1e-5, f"{name}: {n}")
        out[name] = {"counts": counts, "before": before, "breaks": new_breaks,
                     "backends": set(compiled_with)}
        compiled_with.clear()
    return out


def _import_for_the_ranks():
    """What every rank imports to build its model and compile it (transformers' three models,
    AOTAutograd, Inductor with its networkx / sympy / scipy: 1,400 modules, 3.4 s of CPU),
    imported once here so that the forked ranks share it instead of each importing it (the
    ranks' imports warned nowhere: their third-party deprecation warnings are not shown here
    either)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import torch._functorch.aot_autograd  # noqa: F401
        import torch._inductor.compile_fx  # noqa: F401
        from transformers import (  # noqa: F401
            GPT2LMHeadModel,
            LlamaForCausalLM,
            MixtralForCausalLM,
        )


def test_compiled_blocks_equal_eager_without_recompiles():
    _import_for_the_ranks()
    results = run_local(_worker, 4, LAYOUTS, LAYOUTS_BACKEND, timeout_s=600)
    results += run_local(_worker, 1, ONE_PROCESS, ONE_PROCESS_BACKEND, timeout_s=300)
    for rank, result in enumerate(results):
        for i, (name, r) in enumerate(result.items()):
            backend = ONE_PROCESS_BACKEND if name in ONE_PROCESS else LAYOUTS_BACKEND
            assert r["backends"] == {backend}, \
                f"rank {rank} {name}: blocks compiled with {r['backends'] or 'nothing'}"
            first, *later = r["counts"]
            assert first[1] > r["before"][1] or i > 0, \
                f"rank {rank} {name}: nothing was compiled"
            assert all(c == first for c in later), \
                f"rank {rank} {name}: recompiled after step 1: {r['counts']}"
            expected = EXPECTED_BREAKS[name]
            seen = {e for e in expected for k in r["breaks"] if e in k}
            unexpected = [k for k in r["breaks"] if not any(e in k for e in expected)]
            assert not unexpected, f"rank {rank} {name}: graph breaks {unexpected}"
            assert seen == expected, f"rank {rank} {name}: breaks {seen}, expected {expected}"


def _fp8_graphs(layers: int) -> tuple[int, int]:
    """(dynamo's unique graphs, frames) after one compiled step of a Llama of `layers` blocks
    whose linears all run in float8 (emulated), one process."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    from transformers import LlamaConfig, LlamaForCausalLM

    import megapar

    torch._dynamo.reset()
    torch.compile = functools.partial(torch.compile, backend="aot_eager")  # a forked worker's
    torch.manual_seed(3)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=layers, num_attention_heads=4,
                                         num_key_value_heads=2, max_position_embeddings=16))
    engine = megapar.prepare(model, micro_batch_size=2, lr=3e-3, compile=True, fp8="tensorwise",
                             fp8_emulate=True, fp8_layers="all")
    engine.train_step(_batches(1)[0])
    return counters["stats"]["unique_graphs"], counters["frames"]["total"]


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="--fp8 needs torchao")
def test_float8_blocks_share_one_compiled_graph():
    """--fp8 with --compile: each block compiled its own graph (the traced id() of its weight, a
    guard on which parameter it is), so past torch's 8 recompilations a model's later blocks ran
    eagerly, and fp8_bench.py --compile timed them so (a compile tester's finding). Identical
    blocks share one graph: the graphs of 3 blocks are 1 block's."""
    one, three = (run_local(_fp8_graphs, 1, n, timeout_s=300)[0] for n in (1, 3))
    assert three == one, f"3 blocks: {three} (graphs, frames); 1 block: {one}"


def _documents_recomputed(compile_: bool) -> tuple[list[float], dict]:
    """Two steps of a one-block Llama on packed documents (block-causal attention, reset
    positions, eod_id 5) under full recomputation, one process, compiled ("aot_eager") or
    eager."""
    import torch._dynamo
    from canonical import gather_canonical
    from transformers import LlamaConfig, LlamaForCausalLM

    import megapar

    torch._dynamo.reset()
    torch.compile = functools.partial(torch.compile, backend="aot_eager")  # a forked worker's
    torch.manual_seed(3)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=4,
                                         num_key_value_heads=2, max_position_embeddings=16))
    engine = megapar.prepare(model, micro_batch_size=2, lr=3e-3, adam_eps=ADAM_EPS,
                             compile=compile_, recompute="full", attention_mask_type="block_causal",
                             reset_position_ids=True, eod_id=5)
    losses = []
    for batch in _batches(2):
        batch["input_ids"][:, 3] = 5  # a document boundary in every row
        losses.append(engine.train_step(batch))
    return losses, {k: v.clone() for k, v in gather_canonical(engine.model).items()}


def test_compiled_blocks_on_documents_recompute_as_eager():
    """A block's document mask was made inside its compiled forward and found made in its
    recomputation: two graphs saving different tensors, which torch.utils.checkpoint refused
    ("Recomputed values ... have different metadata"; fuzz seed 8010). The mask is made
    eagerly now, an input of one graph."""
    (eager, weights), (compiled, compiled_weights) = (
        run_local(_documents_recomputed, 1, c, timeout_s=300)[0] for c in (False, True))
    assert_close(torch.tensor(compiled), torch.tensor(eager), 1e-5, "losses")
    for name, w in weights.items():
        assert_close(compiled_weights[name], w, 1e-5, name)
