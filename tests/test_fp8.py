"""--fp8: torchao's float8 training in megapar's parallel linears, in torchao's emulate mode.

Emulation makes the same float8 casts and scales as a GPU run and multiplies the dequantised
values in fp32, so everything here is exact to fp32 rounding, and that is the tolerance:

- one process equals, bitwise, the same megapar model with torchao's own `Float8Linear` in
  place of every parallel linear (megapar's matmul is torchao's), and transformers' Llama
  converted by torchao's `convert_to_float8_training` within 1e-5;
- tp 2 (with and without sequence parallelism) equals one process: the amax of an operand
  split over tp is reduced (MAX) over the tp group, so every element gets the scale it gets in
  one process (a control shows tp 2 without the reduction differs by float8 rounding, ~5e-2);
- the float8 linears are chosen by their whole N x K: tp 2 runs the ones one process runs
  (and equals it), and a tp splitting one into shards not multiples of 16 is refused;
- training steps with pp (recompute full), dp under ZeRO-1 / 2 / 3, tp with sequence
  parallelism and zb-h1 equal one process under --fp8;
- checkpoints hold fp32 weights; one saved under --fp8 loads into an fp32 run and back;
- a step's micro-batches share each weight's cast, bitwise as casting per use;
- ZeRO-3 gathers tensorwise weights as float8 bytes (its float8 all-gather), bitwise as fp32
  gathers with per-use casts, at a quarter of the bytes; rowwise gathers fp32;
- where torch has float8 matmuls on the CPU (`torch._scaled_mm`, x86), the path a GPU runs,
  torchao's float8 tensors through that kernel, equals the emulation at tp 2 and at ZeRO-3
  dp 2 (the gathered float8 weights) in bf16, and at tp 2 in fp16 (rowwise where the CPU kernel takes rowwise
  scales: torch 2.13's does, 2.11's takes one scale a tensor only).

torchao is an optional dependency (megapar[fp8]); without it these tests skip (the checks of
--fp8's refusals run either way).
"""

import dataclasses
import importlib.util

import pytest
import torch
import transformers
from tp_utils import assert_close, make_mesh

import megapar
from megapar.checkpoint.hf import HFReader, load_hf_weights
from megapar.checkpoint.hf_names import llama_canonical
from megapar.launcher import run_local
from megapar.models import Llama
from megapar.tensor_parallel.partition import gather_full
from megapar.training.config import TrainConfig
from megapar.training.validate import UsageError, check_settings
from megapar.training.validate_fp8 import Fp8Error, check_fp8_layout

HAVE_TORCHAO = importlib.util.find_spec("torchao") is not None
needs_torchao = pytest.mark.skipif(
    not HAVE_TORCHAO, reason="torchao is not installed (pip install -e '.[fp8]')"
)
VOCAB, SEQ, B = 96, 16, 4
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
            tie_word_embeddings=False)  # head size 16: k / v at tp 2 are 16 x 64


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    # Seed 1: fp32 rounding differences (HF's attention vs megapar's, tp's summation order,
    # ~1e-7) move an operand across a float8 rounding boundary only rarely, but then by a whole
    # float8 step: with seed 0 one element does, and HF and tp 2 differ from one process by
    # 4.5e-5 (logits) / 3e-4 (gradients); seeds 1, 2, 3 have no such element (< 6e-7).
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    path = tmp_path_factory.mktemp("fp8") / "llama"
    model.save_pretrained(path)
    return str(path)


def _batch():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (B, SEQ), generator=gen)
    labels = torch.cat([ids[:, 1:], torch.full((B, 1), -100)], dim=1)  # HF shifts inside
    return ids, labels


def _torchao_reference(path, recipe):
    """transformers' Llama with torchao's Float8Linear in every block linear (the head kept)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    hf = transformers.LlamaForCausalLM.from_pretrained(path, attn_implementation="eager")
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    convert_to_float8_training(hf, config=config, module_filter_fn=lambda m, fqn: "lm_head" != fqn)
    converted = sum(type(m).__name__ == "Float8Linear" for m in hf.modules())
    assert converted == 7 * TINY["num_hidden_layers"]
    ids, _ = _batch()
    out = hf(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {k: p.grad for k, p in hf.named_parameters()}

    def get(key):
        return grads["model." + key] if "model." + key in grads else grads[key]

    reader = HFReader(path)
    return out.logits.detach(), out.loss.detach(), lambda n: llama_canonical(n, get, reader.config)


def _swap_in_float8linear(model, recipe):
    """The reference: every parallel linear of a one-process megapar model (there F.linear with
    its weight) runs as torchao's own `Float8Linear` over the same parameters."""
    from torch import nn
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    from megapar.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=True)
    swapped = 0
    for module in model.modules():
        if isinstance(module, ColumnParallelLinear | RowParallelLinear):
            n, k = module.weight.shape
            linear = nn.Linear(k, n, bias=False, device="meta")
            linear.weight, linear.bias = module.weight, module.bias
            f8 = Float8Linear.from_float(linear, config)
            module.forward = lambda x, entered=False, f8=f8: f8(x)
            swapped += 1
    return swapped


def _torchao_megapar(path, recipe):
    model = Llama(HFReader(path).config, make_mesh(1))
    load_hf_weights(model, HFReader(path))
    assert _swap_in_float8linear(model, recipe) == 7 * TINY["num_hidden_layers"]
    ids, labels = _batch()
    logits = gather_full(model(None, {"input_ids": ids}).detach(), 2, (B, SEQ, VOCAB), None)
    loss = model(None, {"input_ids": ids, "labels": labels})
    loss.backward()
    grads = {n: gather_full(p.grad, p.tp_dim, p.full_shape, None)
             for n, p in model.named_parameters()}
    return logits, loss.detach(), grads.__getitem__


def _megapar_fp8(path, recipe, tp, sequence_parallel=False, reduce_amax=True):
    from megapar.mesh import Layout, Mesh
    from megapar.tensor_parallel.fp8_convert import convert_to_fp8

    rank = torch.distributed.get_rank() if tp > 1 else 0
    mesh = Mesh(Layout(tp, 1, 1), rank, sequence_parallel=sequence_parallel) if tp > 1 else \
        make_mesh(1)
    reader = HFReader(path)
    model = Llama(reader.config, mesh)
    assert load_hf_weights(model, reader) == []
    summary = convert_to_fp8(model, recipe, emulate=True, layers="all")
    if not reduce_amax:  # the control: each rank scales by its own shard's amax
        for m in model.modules():
            if getattr(m, "fp8", None) is not None:
                m.fp8 = dataclasses.replace(m.fp8, x_split=None, w_t_split=None, dy_split=None)
    ids, labels = _batch()
    logits = model(None, {"input_ids": ids})
    logits = gather_full(logits.detach(), 2, (B, SEQ, VOCAB), mesh.tp_group)
    loss = model(None, {"input_ids": ids, "labels": labels})
    loss.backward()
    from megapar.tensor_parallel.sequence_parallel import sync_sequence_parallel_grads

    sync_sequence_parallel_grads(model, mesh.tp_group)
    grads = {n: gather_full(p.grad, p.tp_dim, p.full_shape, mesh.tp_group)
             for n, p in model.named_parameters()}
    return logits, loss.detach(), grads, summary


def _compare(ours, reference, what, tol=1e-5):
    """Logits, loss and every gradient within `tol` relative (0: bitwise equal)."""
    logits, loss, grads, _ = ours
    ref_logits, ref_loss, ref_grad = reference
    pairs = [("logits", logits, ref_logits), ("loss", loss, ref_loss)]
    pairs += [(f"grad of {name}", g, ref_grad(name)) for name, g in grads.items()]
    for name, a, b in pairs:
        if tol == 0:
            assert torch.equal(a, b), f"{what}: {name} differs"
        else:
            assert_close(a, b, tol, f"{what}: {name}")


@needs_torchao
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_one_process_equals_torchaos_float8linear(hf_dir, recipe):
    reference = _torchao_megapar(hf_dir, recipe)
    ours = _megapar_fp8(hf_dir, recipe, 1)
    assert "14 linears in float8" in ours[3], ours[3]
    _compare(ours, reference, f"{recipe} tp 1", tol=0.0)  # the same operations: bitwise
    # and transformers' Llama converted by torchao's convert_to_float8_training
    hf_logits, hf_loss, _ = _torchao_reference(hf_dir, recipe)
    assert_close(ours[0], hf_logits, 1e-5, "logits vs transformers + torchao")
    assert_close(ours[1], hf_loss, 1e-5, "loss vs transformers + torchao")
    # float8 is really in the loop: fp32 megapar differs from it by float8 rounding
    model = Llama(HFReader(hf_dir).config, make_mesh(1))
    load_hf_weights(model, HFReader(hf_dir))
    ids, labels = _batch()
    fp32 = model(None, {"input_ids": ids, "labels": labels}).detach()
    assert abs(fp32 - reference[1]).item() > 1e-4


@needs_torchao
def test_the_line_names_what_always_stays_in_high_precision():
    """A mixture of experts' router and routed experts (grouped matmuls) are named as kept, as
    are the embedding and an untied LM head; the attention's linears convert."""
    from megapar.models import build_model
    from megapar.models.recipes import resolve_model
    from megapar.tensor_parallel.fp8_convert import convert_to_fp8

    model = build_model(resolve_model("mixtral-tiny"), make_mesh(1))
    line = convert_to_fp8(model, "tensorwise", emulate=True, layers="all")
    assert line.startswith("fp8 tensorwise (emulated: fp32 products): 16 linears in float8 ("), line
    assert line.endswith(
        "; always in high precision: embed.word, layers.mlp.router, layers.mlp.experts, head"
    ), line


@needs_torchao
def test_the_float8_matmul_looks_nothing_up_per_call(monkeypatch):
    """torchao's modules are looked up once, into the layer's spec: the lookup sets log
    levels, which --compile cannot trace (it broke every compiled float8 layer's graph)."""
    from megapar.tensor_parallel import fp8

    layer = torch.nn.Linear(32, 16, bias=False)
    spec = fp8.make_spec("rowwise", True, None, "out")
    monkeypatch.setattr(fp8, "_torchao", lambda: pytest.fail("torchao looked up per call"))
    x = torch.randn(8, 32, requires_grad=True)
    fp8.fp8_linear(x, layer.weight, None, spec).sum().backward()
    assert x.grad is not None and layer.weight.grad is not None


@needs_torchao
@pytest.mark.parametrize("recipe,sp", [("tensorwise", False), ("rowwise", True)])
def test_tp2_equals_one_process(hf_dir, recipe, sp):
    reference = _torchao_megapar(hf_dir, recipe)
    for ours in run_local(_megapar_fp8, 2, hf_dir, recipe, 2, sp):
        _compare(ours, reference, f"{recipe} tp 2 sp={sp}")


@needs_torchao
def test_tp2_without_the_amax_reduction_differs(hf_dir):
    """The control for the test above: scales from each rank's own shard change the numbers."""
    reference = _torchao_megapar(hf_dir, "tensorwise")
    ours = run_local(_megapar_fp8, 2, hf_dir, "tensorwise", 2, False, False)[0]
    with pytest.raises(AssertionError, match="relative error"):
        _compare(ours, reference, "tensorwise tp 2, per-shard amax", tol=1e-3)


# --- training steps: pp, ZeRO, recompute; checkpoints --------------------------------------

GPT = dict(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
           embd_pdrop=0.0, attn_pdrop=0.0)
STEPS, GBS = 3, 8


def _batches():
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS + 1):
        ids = torch.randint(0, VOCAB, (GBS, SEQ), generator=gen)
        out.append({"input_ids": ids, "labels": (ids + 1) % VOCAB})
    return out


def _train(save=None, load=None, first=0, steps=STEPS, cp_amax=True, **layout):
    """`steps` steps from batch `first` (after loading `load`); with `save`: saved, and one more
    step's loss appended. `cp_amax=False`: the control, each cp rank scales by its own tokens."""
    fp8 = layout.pop("fp8", "tensorwise")
    engine = megapar.prepare(transformers.GPT2Config(**GPT), micro_batch_size=2, lr=3e-3,
                             global_batch_size=GBS, seq_len=SEQ, seed=5, clip_grad=1.0,
                             fp8=fp8, fp8_emulate=fp8 != "off",
                             fp8_layers="all" if fp8 != "off" else "auto", **layout)
    if not cp_amax:
        for m in engine.model.modules():
            if getattr(m, "fp8", None) is not None:
                m.fp8 = dataclasses.replace(m.fp8, cp_group=None)
    if load is not None:
        engine.load(load)
    batches = _batches()
    losses = [engine.train_step(b) for b in batches[first:first + steps]]
    dtypes = {p.dtype for p in engine.model.parameters()}
    if save is not None:
        engine.save(save)
        losses.append(engine.train_step(batches[first + steps]))
    return losses, dtypes, engine.fp8_summary


@needs_torchao
def test_training_steps_in_every_layout_equal_one_process():
    serial, dtypes, summary = _train()
    assert dtypes == {torch.float32} and summary.startswith("fp8 tensorwise (emulated")
    fp32 = _train(fp8="off")[0]
    assert abs(fp32[-1] - serial[-1]) > 1e-5  # float8 changes the numbers
    for layout in ({"pp": 2, "recompute": "full"}, {"zero": 1}, {"zero": 2}, {"zero": 3},
                   {"tp": 2, "sequence_parallel": True}, {"pp": 2, "schedule": "zb-h1"},
                   {"cp": 2}):
        world = layout.get("pp", 1) * layout.get("tp", 1) * layout.get("cp", 1)
        world *= 2 if "zero" in layout else 1
        for losses, _, _ in run_local(_train, world, **layout):
            assert_close(torch.tensor(losses), torch.tensor(serial), 1e-5, f"{layout}")
    # rowwise under cp: dW's operands are scaled along the tokens cp splits
    rowwise = _train(fp8="rowwise")[0]
    for losses, _, _ in run_local(_train, 2, fp8="rowwise", cp=2):
        assert_close(torch.tensor(losses), torch.tensor(rowwise), 1e-5, "rowwise cp 2")
    # the control: scales from each cp rank's own tokens change the numbers
    for losses, _, _ in run_local(_train, 2, cp=2, cp_amax=False):
        with pytest.raises(AssertionError, match="relative error"):
            assert_close(torch.tensor(losses), torch.tensor(serial), 1e-5, "cp 2, own amax")


WIDE = dict(GPT, n_inner=1056)
"""The MLP's fc is 1056 x 32: tensorwise's size rule converts it by its whole N (> 1024), which
is 528 at tp 2; nothing else converts."""


def _wide_steps(tp=1):
    engine = megapar.prepare(transformers.GPT2Config(**WIDE), micro_batch_size=2, lr=3e-3,
                             global_batch_size=GBS, seq_len=SEQ, seed=5, clip_grad=1.0, tp=tp,
                             fp8="tensorwise", fp8_emulate=True)
    return [engine.train_step(b) for b in _batches()[:2]], engine.fp8_summary


@needs_torchao
def test_the_float8_linears_are_the_models_at_every_tp():
    """Which linears run in float8 is read off their whole N x K, so tp 2 converts what one
    process converts and computes what it computes (within fp32 rounding: the parity tests'
    1e-5). The rule read each rank's shard: tp 2 kept the 528-wide fc in high precision where
    one process ran it in float8 (2 linears against 0), and its losses differed."""
    serial, line = _wide_steps()
    assert line.startswith("fp8 tensorwise (emulated: fp32 products): 2 linears in float8 "
                           "(layers.mlp.fc 1056x32); kept in high precision: "), line
    for losses, tp_line in run_local(_wide_steps, 2, 2):
        assert tp_line == line
        assert_close(torch.tensor(losses), torch.tensor(serial), 1e-5, "tp 2, float8 fc")


def test_a_tp_that_cannot_run_the_float8_linears_is_refused_before_the_workers(capsys):
    """--fp8-layers all runs llama-tiny's 176-wide gate, up and down in float8; at tp 2 their
    shards are 88 wide, and FP8 matmuls need multiples of 16: megapar-train refuses the tp in
    one line (exit 2) before any worker starts, and megapar-plan finds the candidate invalid
    for the same reason; tp 1 runs."""
    from megapar.cli.plan import main as plan_main
    from megapar.cli.train import main as train_main
    from megapar.models.recipes import resolve_model
    from megapar.training.validate_fp8 import fp8_layout_problem

    config = resolve_model("llama-tiny")
    problem = fp8_layout_problem(config, 2, "tensorwise", "all")
    assert problem == ("layers.mlp.gate 176x64 runs in float8 and is 88x64 on each tp rank: FP8 "
                       "matmuls need N and K multiples of 16; only tp 1 splits every float8 "
                       "linear into multiples of 16"), problem
    assert fp8_layout_problem(config, 1, "tensorwise", "all") is None
    assert fp8_layout_problem(config, 2, "tensorwise", "auto") is None  # none converts
    wider = dataclasses.replace(config, intermediate_size=256)  # 2 kv heads: k / v whole at tp 4
    whole = fp8_layout_problem(wider, 4, "rowwise", "all")
    assert whole == ("layers.attn.k 32x64 runs in float8 and is held whole on every tp rank (tp "
                       "does not divide the kv heads); tp 1 or 2 split every float8 linear "
                       "into multiples of 16 and divide the kv heads"), whole
    assert fp8_layout_problem(wider, 2, "rowwise", "all") is None  # the tp it names runs
    # 6 heads of 24, 2 kv heads: tp 2 and 3 each split some linear off 16, and tp 3 also holds
    # k / v whole; no tp but 1 runs, and that is what either refusal names (tp 2's named "a tp
    # dividing 3", leaving out the kv heads its split k / v have: a re-test's finding)
    from megapar.models.config import config_from_dict

    narrow = config_from_dict({"model_type": "llama", "vocab_size": 1000, "hidden_size": 144,
                               "num_attention_heads": 6, "num_key_value_heads": 2,
                               "intermediate_size": 432, "num_hidden_layers": 1})
    for tp in (2, 3):
        assert "; only tp 1 splits" in fp8_layout_problem(narrow, tp, "tensorwise", "all")
    argv = ["--model", "llama-tiny", "--dry-run", "--seq-len", "16", "--micro-batch-size",
            "1", "--global-batch-size", "2", "--fp8", "tensorwise", "--fp8-layers", "all"]
    assert train_main(argv + ["--tp", "2", "--world-size", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.endswith(
        f"--fp8 tensorwise --fp8-layers all at --tp 2: {problem}; use --tp 1, or drop --fp8 "
        f"tensorwise and --fp8-layers all\n"
    ), err  # "use such a tp" where tp 1 is the only one (a fuzz run's wording point); "or
    # --fp8 off" was refused next for --fp8-layers, which applies to --fp8 alone (another)
    # beside --sp-regather, which tp 1 refuses in turn, the fix drops it too (a fuzz run's)
    assert train_main(argv + ["--tp", "2", "--world-size", "2", "--sequence-parallel",
                              "--sp-regather"]) == 2
    assert "; use --tp 1 (dropping --sp-regather, which needs tp > 1), or drop --fp8" in \
        capsys.readouterr().err
    plan = ["--model", "llama-tiny", "--gpus", "2", "--global-batch-size", "4", "--seq-len",
            "64", "--fp8", "tensorwise", "--fp8-layers", "all", "--explain", "tp=2,mbs=2"]
    assert plan_main(plan) == 1  # megapar-plan's answer for a candidate it finds invalid
    assert f"invalid: fp8 tensorwise with fp8_layers all at tp 2: {problem}" in (
        capsys.readouterr().out)


def _weight_casts(recipe="tensorwise", cached=True, tp=1):
    """Three steps of m = 4 micro-batches (dp 1): the losses, the weight
    casts per step (`_cast` of the WEIGHT role), the tp all-reduces per step, and the cache's
    size after the steps."""
    from megapar.comm_count import count_collectives
    from megapar.tensor_parallel import fp8

    engine = megapar.prepare(transformers.GPT2Config(**GPT), micro_batch_size=2, lr=3e-3,
                             global_batch_size=GBS, seq_len=SEQ, seed=5, clip_grad=1.0, tp=tp,
                             fp8=recipe, fp8_emulate=True, fp8_layers="all")
    cache = engine.step_fn.fp8_weight_casts
    assert cache is not None
    if not cached:
        engine.step_fn.fp8_weight_casts = None
    casts, cast = [], fp8._cast

    def counting(t, c, role, *args, **kwargs):
        casts.append(role)
        return cast(t, c, role, *args, **kwargs)

    fp8._cast = counting
    losses, reduces = [], []
    try:
        for batch in _batches()[:STEPS]:
            with count_collectives() as calls:
                losses.append(engine.train_step(batch))
            reduces.append(sum(c.op == "all_reduce" and c.numel == 1 and c.group_size == tp
                               for c in calls))
    finally:
        fp8._cast = cast
    weight = fp8._torchao()[1].GemmInputRole.WEIGHT
    return losses, sum(r is weight for r in casts) / STEPS, reduces, len(cache.casts)


@needs_torchao
@pytest.mark.parametrize("recipe,per_weight", [("tensorwise", 1), ("rowwise", 2)])
def test_a_steps_micro_batches_share_each_weights_float8_cast(recipe, per_weight):
    """As Transformer Engine's first-micro-batch cache: the weights do not change within a
    step, so each is cast once per step (tensorwise: its forward cast serves dX too; rowwise:
    once per axis), not in every micro-batch's forward and backward; the numbers are the
    same bitwise, and nothing is held after the step."""
    linears, m = 4 * GPT["n_layer"], GBS // 2  # GPT-2's qkv, proj, fc, fc2 per block
    cached, per_step, _, left = _weight_casts(recipe)
    uncached, every_use, _, _ = _weight_casts(recipe, cached=False)
    assert cached == uncached, (cached, uncached)
    assert (per_step, every_use, left) == (per_weight * linears, 2 * m * linears, 0)


@needs_torchao
def test_cached_weight_casts_reduce_each_weights_amax_over_tp_once_per_step():
    """At tp 2 every linear's weight is split, so its tensorwise amax is all-reduced at each
    cast: 2 per micro-batch (forward, dX) become 1 per step; the tp ranks stay paired and the
    losses are those of uncached casts."""
    cached = run_local(_weight_casts, 2, "tensorwise", True, 2)
    uncached = run_local(_weight_casts, 2, "tensorwise", False, 2)
    linears, m = 4 * GPT["n_layer"], GBS // 2
    for ours, theirs in zip(cached, uncached, strict=True):
        assert ours[0] == theirs[0], (ours[0], theirs[0])
        assert [a - b for a, b in zip(theirs[2], ours[2], strict=True)] == [
            linears * (2 * m - 1)
        ] * STEPS, (theirs[2], ours[2])


def _zero3_float8(recipe="tensorwise", tp=1, steps=STEPS):
    """`steps` steps under ZeRO-3 at dp 2 (m = 2 micro-batches a rank) and an evaluation,
    twice: with ZeRO-3's float8 all-gather and without (the control: the same units gathered
    in fp32, the weights cast per use). Per run: the losses, the evaluation's loss, per step
    the bytes put into uint8 all-gathers and the sizes of the amax all-reduces (one element per
    float8 weight), and the float8 units' float8 buffer bytes. On a GPU with FP8 matmuls
    (tests/test_cuda_shared.py) torch's kernels, else torchao's emulation."""
    from megapar.comm_count import count_collectives

    kernels = torch.cuda.is_available() and torch.cuda.get_device_capability(0) >= (8, 9)
    runs = []
    for float8 in (True, False):
        engine = megapar.prepare(transformers.GPT2Config(**GPT), micro_batch_size=2, lr=3e-3,
                                 global_batch_size=GBS, seq_len=SEQ, seed=5, clip_grad=1.0,
                                 tp=tp, zero=3, fp8=recipe, fp8_emulate=not kernels,
                                 fp8_layers="all")
        units = engine.sharded_params.float8.units
        if not float8:
            engine.step_fn.zero3_float8 = engine.step_fn.fp8_weight_casts = None
        losses, gathered8, reduces = [], [], []
        for batch in _batches()[:steps]:
            with count_collectives() as calls:
                losses.append(engine.train_step(batch))
            gathered8.append(sum(c.bytes for c in calls if c.op.startswith("all_gather")
                                 and c.dtype == torch.uint8))
            reduces.append([c.numel for c in calls
                            if c.op == "all_reduce" and c.numel == 4 * GPT["n_layer"]])
        held = [u.cast.nbytes for u in units]
        runs.append((losses, engine.eval_step(_batches()[STEPS]), gathered8, reduces, held))
    return runs


@needs_torchao
def test_zero3_gathers_the_float8_weights_in_float8():
    """torchao's float8 all-gather for ZeRO-3 (at tp 2 x dp 2): each rank casts its slice of
    a tensorwise weight with the weight's scale (its amax MAX-reduced over dp and over tp, once
    a step for the whole stage) and the ranks gather the float8 bytes, a quarter of the fp32
    gather, to the same float8 weights: the losses are bitwise those of fp32 gathers and
    per-use casts, and an evaluation after the steps (fp32 gathers again) too. (One process
    equals ZeRO-3 under --fp8 in `test_training_steps_in_every_layout_equal_one_process`.)"""
    m, weights = GBS // 2 // 2, 4 * GPT["n_layer"]
    for ours, theirs in run_local(_zero3_float8, 4, "tensorwise", 2):
        assert (ours[0], ours[1]) == (theirs[0], theirs[1]), (ours[:2], theirs[:2])
        held = ours[4]
        assert len(held) == GPT["n_layer"]  # a float8 unit per block
        # every float8 unit gathered in each micro-batch's forward and backward, as bytes
        # (each rank puts in its slice: 1 / dp of the float8 buffer)
        assert ours[2] == [2 * m * sum(held) // 2] * STEPS and theirs[2] == [0] * STEPS
        # one amax all-reduce over dp and one over tp a step, of every float8 weight
        assert ours[3] == [[weights] * 2] * STEPS and theirs[3] == [[]] * STEPS


@needs_torchao
def test_zero3_keeps_rowwise_weights_in_fp32_gathers():
    """Rowwise scales cover one row or column of a weight, which a slice does not hold
    whole: no float8 units, no float8 gathers (torchao gathers only tensorwise weights in
    float8)."""
    (losses, _, gathered8, _, held), _ = run_local(_zero3_float8, 2, "rowwise", 1, 1)[0]
    assert held == [] and gathered8 == [0] and len(losses) == 1


def _cpu_float8_kernels(recipe: str = "tensorwise") -> str | None:
    """Why torch's float8 matmul (`torch._scaled_mm`) cannot run on this CPU with `recipe`'s
    scales (tensorwise: one a tensor; rowwise: one a row of each operand); None: it can."""
    if not HAVE_TORCHAO:
        return "torchao is not installed (pip install -e '.[fp8]')"
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    scale = torch.ones(16, 1) if recipe == "rowwise" else torch.tensor(1.0)
    try:
        torch._scaled_mm(a, a.t(), scale_a=scale, scale_b=scale.t(), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError) as exc:
        return (f"torch {torch.__version__} has no {recipe} float8 matmul on this CPU "
                f"({exc})")[:200]
    return None


def _kernels_and_emulation(recipe, tp, zero=0, precision="bf16"):
    """Three steps (bf16 or fp16) with the float8 products emulated, then with torch's
    kernels."""
    from megapar.training import prepare as prepare_module

    prepare_module.check_fp8 = lambda cfg, *args, **kwargs: None  # (a forked rank's copy)
    runs, kernel = [], torch._scaled_mm
    for emulate in (True, False):
        calls = []
        torch._scaled_mm = lambda *args, **kwargs: calls.append(1) or kernel(*args, **kwargs)
        try:
            engine = megapar.prepare(transformers.GPT2Config(**GPT), micro_batch_size=2,
                                     lr=3e-3, global_batch_size=GBS, seq_len=SEQ, seed=5,
                                     clip_grad=1.0, tp=tp, precision=precision, fp8=recipe,
                                     fp8_emulate=emulate, fp8_layers="all", zero=zero)
            runs.append(([engine.train_step(b) for b in _batches()[:STEPS]], len(calls)))
        finally:
            torch._scaled_mm = kernel
    return runs


@pytest.mark.skipif(_cpu_float8_kernels() is not None, reason=str(_cpu_float8_kernels()))
@pytest.mark.parametrize("recipe,tp,zero,precision", [
    ("tensorwise", 2, 0, "bf16"), ("rowwise", 2, 0, "bf16"), ("tensorwise", 1, 3, "bf16"),
    ("tensorwise", 2, 0, "fp16")])
def test_torchs_float8_kernels_on_the_cpu_equal_the_emulation(recipe, tp, zero, precision):
    """The path a GPU runs, short of its kernels: torchao's float8 tensors through
    `torch._scaled_mm` (their layouts, the cached weight casts reused transposed in the
    backward; under ZeRO-3 at dp 2, the float8 weights gathered as bytes, views into the
    gathered buffer), which torch also has on x86 CPUs. At tp 2 (amaxes reduced over tp) and
    ZeRO-3 dp 2 three bf16 steps equal the emulation's within 1e-5: the same casts and scales,
    the products in fp32 either way, rounded to bf16 once; and under fp16 (its loss scale
    multiplying the gradients the float8 casts scale) at tp 2. (--fp8 itself refuses a CPU: these
    kernels are not what a CPU should train with; the test calls prepare past that check.)"""
    if _cpu_float8_kernels(recipe) is not None:  # torch 2.11's CPU kernel: tensorwise only
        pytest.skip(_cpu_float8_kernels(recipe))
    micro_batches = GBS // 2 // (2 // tp)  # a rank's: tp 2, or dp 2
    products = 3 * micro_batches * 4 * GPT["n_layer"] * STEPS  # Y, dX, dW of every linear
    for (emulated, none), (kernels, calls) in run_local(_kernels_and_emulation, 2, recipe, tp,
                                                        zero, precision):
        assert (none, calls) == (0, products), (none, calls)
        assert_close(torch.tensor(kernels), torch.tensor(emulated), 1e-5, f"{recipe} kernels")


@needs_torchao
def test_checkpoint_saved_under_fp8_is_fp32_and_moves_to_fp32_runs_and_back(tmp_path):
    from safetensors import safe_open

    fp8_run = _train(save=tmp_path / "fp8", steps=1)  # a step, saved, a second step
    seen = set()
    for f in (tmp_path / "fp8").rglob("*.safetensors"):
        with safe_open(f, "pt") as reader:
            seen |= {reader.get_tensor(k).dtype for k in reader.keys()}
    assert torch.float32 in seen and not seen & {torch.float8_e4m3fn, torch.float8_e5m2}, seen
    step = next((tmp_path / "fp8").glob("step_*"))
    # into an fp32 run (which trains a step from it) and saved there untouched ...
    fp32_run = _train(save=tmp_path / "fp32", load=step, first=1, steps=0, fp8="off")
    assert fp32_run[1] == {torch.float32} and fp32_run[0][0] != fp8_run[0][1]
    # ... and back under --fp8: the same weights, so the fp8 run's second step exactly
    back = _train(load=next((tmp_path / "fp32").glob("step_*")), first=1, steps=1)
    assert back[0] == [fp8_run[0][1]]


@needs_torchao
def test_the_fp8_line_says_a_moe_stage_keeps_its_experts():
    """The routers and routed experts are no parallel linears, so they stay in high precision;
    the run's line says so with their share (it named only the embedding and the head, so
    mixtral-8x7b read as converted where 97 % of its parameters were not)."""
    from megapar.models.recipes import resolve_model
    from megapar.training.engine_parts import stage_for

    cfg = TrainConfig(fp8="rowwise", fp8_emulate=True, fp8_layers="all")
    config = dataclasses.replace(resolve_model("mixtral-tiny"), vocab_size=VOCAB)
    model, line = stage_for(cfg, config, make_mesh(1))
    experts = sum(p.numel() for n, p in model.named_parameters() if "experts" in n)
    share = experts / sum(p.numel() for p in model.parameters())
    assert 0.5 < share < 1 and line.endswith(
        f"; the routed experts hold {share:.0%} of this rank's parameters"
    ) and "high precision: embed.word, layers.mlp.router, layers.mlp.experts" in line, line
    dense = dataclasses.replace(resolve_model("llama-tiny"), vocab_size=VOCAB)
    dense = stage_for(cfg, dense, make_mesh(1))[1]
    assert "experts" not in dense and "always in high precision: embed.word" in dense, dense


@needs_torchao
def test_the_fp8_line_of_a_pipeline_stage_names_its_pipeline_rank():
    """The run prints rank 0's line; at pp 2 it read as the model's ("14 linears in float8 ...;
    always in high precision: embed.word" for llama-tiny's 28, its head unnamed). Each stage's
    line now names its pipeline rank (the dry run rehearses both here); one stage's none. A
    rank's virtual chunks are named as the layers' parameters are (was chunks.layers.attn.q)."""
    from megapar.dryrun import dry_run
    from megapar.mesh import Layout
    from megapar.models.recipes import resolve_model

    cfg = TrainConfig(pp=2, seq_len=16, micro_batch_size=2, global_batch_size=4,
                      schedule="interleaved", virtual_stages=2,
                      fp8="tensorwise", fp8_layers="all", dry_run=True)
    config = dataclasses.replace(resolve_model("llama-tiny"), vocab_size=VOCAB)
    first, last = (next(n for n in r.notes if n.startswith("fp8"))
                   for r in dry_run(cfg, config, Layout(1, 2, 1), [0, 1]))
    assert first.startswith("fp8 tensorwise (emulated: fp32 products) on pipeline rank 0 of "
                            "2: 14 linears in float8") and first.endswith("embed.word"), first
    assert last.startswith("fp8 tensorwise (emulated: fp32 products) on pipeline rank 1 of "
                           "2: 14 linears in float8") and last.endswith(": head"), last
    assert "chunks" not in first + last and "(layers.attn.q 64x64," in first, first


@needs_torchao
def test_megapar_trains_fp8_line_of_no_float8_linear_names_fp8_layers_all():
    """megapar-train's line said "0 linears in float8" for a model too small for the size rule
    and left the user to find the flag that converts them anyway: it names --fp8-layers all
    (as megapar.prepare's warning names fp8_layers='all'); under --fp8-layers all it would
    not. Rehearsed (--dry-run), as the run prints it (`fp8_note`)."""
    from megapar.dryrun import dry_run
    from megapar.mesh import Layout
    from megapar.models.recipes import resolve_model
    from megapar.training.engine_parts import fp8_note

    cfg = TrainConfig(seq_len=16, micro_batch_size=2, global_batch_size=2, fp8="tensorwise",
                      dry_run=True)
    config = dataclasses.replace(resolve_model("gpt2-tiny"), vocab_size=VOCAB)
    [report] = dry_run(cfg, config, Layout(1, 1, 1), [0])
    line = next(n for n in report.notes if n.startswith("fp8"))
    advice = "; --fp8-layers all converts those whose dims are multiples of 16"
    assert ": 0 linears in float8; kept in high precision: " in line and line.endswith(
        advice), line
    summary = line.removesuffix(advice)
    assert fp8_note(summary, dataclasses.replace(cfg, fp8_layers="all"), config, 1) == summary
    # at a tp that cannot run them in float8 the flag alone was refused next (llama-tiny's
    # 176-wide MLP is 88 wide at tp 2): it names the tp that can, which takes it
    llama = dataclasses.replace(resolve_model("llama-tiny"), vocab_size=VOCAB)
    [report] = dry_run(cfg, llama, Layout(2, 1, 1), [0])
    line = next(n for n in report.notes if n.startswith("fp8"))
    assert line.endswith(f"{advice} at --tp 1, not at --tp 2 (layers.mlp.gate 176x64 runs in "
                         "float8 and is 88x64 on each tp rank: FP8 matmuls need N and K "
                         "multiples of 16)"), line
    check_fp8_layout(dataclasses.replace(cfg, fp8_layers="all"), llama, 1)  # no refusal
    with pytest.raises(Fp8Error, match="at --tp 2: layers.mlp.gate 176x64"):
        check_fp8_layout(dataclasses.replace(cfg, fp8_layers="all"), llama, 2)


@needs_torchao
def test_prepare_warns_when_fp8_converts_no_linear():
    """megapar.prepare prints no line: fp8='tensorwise' on a model too small for the size rule
    trained with no float8 linear and said nothing. It warns now, naming fp8_layers='all'
    (at a tp that cannot run them so, the tp that can); `engine.fp8_summary` holds the line
    either way."""
    import warnings

    with pytest.warns(UserWarning, match=r"megapar.prepare: fp8='tensorwise' runs none of this "
                                         r"model's linears in float8 \(fp8 tensorwise .*; "
                                         r"fp8_layers='all' converts those"):
        megapar.prepare(transformers.GPT2Config(**GPT), fp8="tensorwise", fp8_emulate=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        engine = megapar.prepare(transformers.GPT2Config(**GPT), fp8="tensorwise",
                                 fp8_emulate=True, fp8_layers="all")
    assert engine.fp8_summary.startswith("fp8 tensorwise (emulated: fp32 products): "), engine
    llama = transformers.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2,
                                     vocab_size=VOCAB)

    def at_tp2():  # rank 0 warns
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            megapar.prepare(llama, tp=2, fp8="tensorwise", fp8_emulate=True)
        return [str(w.message) for w in said if "fp8_layers" in str(w.message)]

    [warned] = run_local(at_tp2, 2)[0]  # rank 0's
    assert "fp8_layers='all' converts those whose dims are multiples of 16 at tp=1, not at " \
        "tp=2 (layers.mlp.gate 176x64 runs in float8" in warned, warned


# --- refusals ------------------------------------------------------------------------------

def _refusal(**fields) -> str:
    with pytest.raises(UsageError) as exc:
        check_settings(TrainConfig(**fields))
    return str(exc.value)


def test_refusals_name_the_problem_and_the_fix(monkeypatch):
    assert "add --fp8 tensorwise" in _refusal(fp8_emulate=True)
    assert "add --fp8 tensorwise" in _refusal(fp8_layers="all")
    assert "choose one of off, tensorwise, rowwise" in _refusal(fp8="e4m3")
    if HAVE_TORCHAO and not torch.cuda.is_available():
        message = _refusal(fp8="tensorwise")
        assert "compute capability >= 8.9" in message and "--fp8-emulate" in message
        check_settings(TrainConfig(fp8="rowwise", fp8_emulate=True))  # accepted
        check_settings(TrainConfig(fp8="rowwise", dry_run=True))  # rehearses the job's GPUs
    if HAVE_TORCHAO and not torch.cuda.is_available():  # prepare's check, before any engine,
        # in its keywords' terms (it named megapar-train's flags: "add --fp8-emulate")
        with pytest.raises(ValueError) as exc:
            megapar.prepare(transformers.GPT2Config(**GPT), fp8="tensorwise")
        said = str(exc.value)
        assert said.startswith("megapar.prepare: fp8='tensorwise' needs a GPU") and (
            "compute capability >= 8.9" in said and "add fp8_emulate=True" in said
            and "--" not in said), said
    with pytest.raises(ValueError) as exc:
        megapar.prepare(transformers.GPT2Config(**GPT), fp8_emulate=True)
    assert str(exc.value) == ("megapar.prepare: fp8_emulate=True applies to fp8: add "
                              "fp8='tensorwise' (or fp8='rowwise') or drop it"), exc.value
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torchao" else real(name, *a))
    message = _refusal(fp8="tensorwise", fp8_emulate=True)
    assert "pip install 'megapar[fp8]'" in message and "\n" not in message


def test_a_resume_does_not_take_fp8_emulate_from_the_checkpoint():
    """--fp8-emulate says how this machine runs the products, not what the run trains: a run
    tried on a laptop under --fp8-emulate and resumed with --load on FP8 GPUs ran emulated
    (fp32 products) there. The recipe and the layers are still the checkpoint's, and on a CPU
    the refusal names the recorded --fp8 as not given, and the fix."""
    from megapar.training.config import parse_args
    from megapar.training.validate_resume import settings_from_checkpoint

    saved = {"fp8": "rowwise", "fp8_emulate": True, "fp8_layers": "all", "eod_mask_loss": True,
             "tokenizer": "my tok"}
    cfg = parse_args(["--load", "ck"])
    note = settings_from_checkpoint(cfg, {"meta": {"train_config": saved}})
    assert (cfg.fp8, cfg.fp8_emulate, cfg.fp8_layers) == ("rowwise", False, "all"), cfg
    # flags a user can paste (a switch was "--compile True", a value with a space unquoted);
    # --compile itself is no longer taken (how a run executes, as --recompute)
    assert note == ["from the checkpoint (not given): --fp8 rowwise, --fp8-layers all, "
                    "--tokenizer 'my tok', --eod-mask-loss"], note
    if HAVE_TORCHAO and not torch.cuda.is_available():
        with pytest.raises(UsageError) as exc:
            check_settings(cfg)
        assert str(exc.value).startswith(
            "--fp8 rowwise (not given: the value --load ck recorded) needs a GPU with FP8 "
            "matmuls") and "give --fp8 off, or add --fp8-emulate" in str(exc.value), exc.value
    # --fp8 off given: the layers' choice is not taken either (it was, said in the note, and
    # saved on into the fp32 run's checkpoints, so a later --fp8 got 'all' unseen: a new user's
    # finding); --fp8-layers given by hand without --fp8 is refused (check_settings)
    cfg = parse_args(["--load", "ck", "--fp8", "off"])
    note = settings_from_checkpoint(cfg, {"meta": {"train_config": saved}})
    assert (cfg.fp8, cfg.fp8_layers) == ("off", "auto") and "fp8" not in note[0], note
    # another recipe given: allowed (the weights are the master dtype's), but it was silent
    assert "--fp8 off differs from the checkpoint's --fp8 rowwise: from here its linears run " \
        "in high precision, so the loss may move by the recipes' rounding" in note, note
    cfg = parse_args(["--load", "ck", "--fp8", "tensorwise"])
    note = settings_from_checkpoint(cfg, {"meta": {"train_config": saved}})
    assert "--fp8 tensorwise differs from the checkpoint's --fp8 rowwise: from here its " \
        "linears run in float8 (tensorwise scales), so the loss may move by the recipes' " \
        "rounding" in note, note
    cfg = parse_args(["--load", "ck", "--fp8", "rowwise"])
    assert not any("differs" in n for n in settings_from_checkpoint(
        cfg, {"meta": {"train_config": saved}})), "the same recipe given again: no note"


@needs_torchao
def test_torchaos_import_warnings_are_held_back():
    """Importing torchao logs, on every rank, its deprecated pytree registration and each kernel
    library it cannot load here ("Failed to load ..._C_cutlass_90a.so": none is what float8
    training runs); megapar's import of it shows neither (a fresh process: torchao imports once)."""
    import subprocess
    import sys

    code = "from megapar.tensor_parallel.fp8 import _torchao; _torchao()"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    shown = [line for line in out.stderr.splitlines()
             if "Failed to load" in line or "register_constant" in line]
    assert not shown, shown
