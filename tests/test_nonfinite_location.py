"""Where the first non-finite value appeared: a transformers model trained through
`megapar.prepare` at tp 2 x pp 2 (and other layouts, schedules and modes), with one weight set to
inf or one gradient poisoned, raises a NonFiniteError naming the module (transformers' name),
forward or backward, the micro-batch and the rank with its coordinates."""

import pytest
import torch

import megapar
from megapar.mesh import Layout

VOCAB, SEQ, G = 96, 16, 8


def _model(kind):
    import transformers as hf

    torch.manual_seed(3)
    if kind == "gpt2":
        return hf.GPT2LMHeadModel(hf.GPT2Config(
            vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=4, n_head=4, n_inner=128,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None,
            eos_token_id=None))
    if kind == "llama":
        return hf.LlamaForCausalLM(hf.LlamaConfig(
            vocab_size=VOCAB, hidden_size=32, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
            bos_token_id=0, eos_token_id=0))
    return hf.BertForMaskedLM(hf.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=32, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0))


INF_AT = {  # a weight whose output column 70 of 128 lies on tp rank 1 (of 2)
    "gpt2": ("transformer.h.2.mlp.c_fc", lambda m: m.transformer.h[2].mlp.c_fc.weight,
             (3, 70)),
    "llama": ("model.layers.2.mlp.up_proj", lambda m: m.model.layers[2].mlp.up_proj.weight,
              (70, 3)),
    "bert": ("bert.encoder.layer.2.intermediate.dense",
             lambda m: m.bert.encoder.layer[2].intermediate.dense.weight, (70, 3)),
}


def _batch(kind):
    x = torch.randint(0, VOCAB, (G, SEQ), generator=torch.Generator().manual_seed(7))
    if kind == "bert":
        labels = x.clone()
        labels[:, ::2] = -100
        return {"input_ids": x, "labels": labels, "attention_mask": torch.ones_like(x),
                "token_type_ids": torch.zeros_like(x)}
    return {"input_ids": x, "labels": (x * 3 + 1) % VOCAB}


def _failed_step(kind, inf, poison, options):
    """A train_step on a model with one inf weight (`inf`) or one poisoned gradient
    (`poison`: ("weight", megapar parameter name, tp rank, pp rank), or ("output", megapar
    module name, ...): the gradient of its output): the error it raised."""
    model = _model(kind)
    if inf:
        name, weight, index = INF_AT[kind]
        with torch.no_grad():
            weight(model)[index] = float("inf")
    engine = megapar.prepare(model, micro_batch_size=2, lr=1e-3, **options)
    engine.train_step(_batch(kind)) if poison else None  # a good step first
    if poison:
        where, name, tp, pp = poison
        mesh = engine.mesh
        if mesh.tp_rank == tp and mesh.pp_rank == pp and where == "weight":
            dict(engine.model.named_parameters())[name].register_hook(
                lambda g: g * float("nan"))
        elif mesh.tp_rank == tp and mesh.pp_rank == pp:  # the gradient of a module's output
            def poison_output(module, args, out):
                out.register_hook(lambda g: g * float("nan"))

            dict(engine.model.named_modules())[name].register_forward_hook(poison_output)
    try:
        engine.train_step(_batch(kind))
    except megapar.faults.stop.NonFiniteError as exc:
        return str(exc)
    return "no error"


def _expect(layout, tp, pp, dp=0, cp=0):
    rank = layout.rank(tp, pp, dp, cp)
    return f"rank {rank} (tp={tp} cp={cp} pp={pp} dp={dp})"


def _check(outcomes, layout, what, tp, pp):
    for message in outcomes:
        assert "first non-finite value (step " in message, message
        assert f"{what}, {_expect(layout, tp, pp)}" in message, message


@pytest.mark.parametrize("kind", ["gpt2", "llama", "bert"])
def test_an_inf_weight_is_named_forward_with_its_micro_batch_and_rank(run, kind):
    """tp 2 x pp 2: block 2 lies on pp stage 1, column 70 of 128 on tp rank 1."""
    outcomes = run(_failed_step, 4, kind, True, None, {"tp": 2, "pp": 2})
    name = INF_AT[kind][0]
    _check(outcomes, Layout(2, 2, 1), f"forward: output of {name}, micro-batch 0", 1, 1)
    assert outcomes[0].startswith("training diverged at step 1: non-finite loss (nan)")


@pytest.mark.parametrize("poison, named", [
    (("weight", "layers.1.mlp.fc.weight", 0, 0), "weight gradient of transformer.h.1.mlp.c_fc"),
    (("output", "layers.2.attn.proj", 1, 1), "input gradient of transformer.h.2.attn.c_proj"),
], ids=["weight-gradient", "activation-gradient"])
def test_a_gradient_poisoned_in_backward_is_named_backward(run, poison, named):
    """The forward is finite; one rank poisons a gradient (a tensor hook): block 1's c_fc
    weight gradient on tp 0 of pp stage 0, or the gradient of block 2's attention output
    projection on tp 1 of pp stage 1, which its backward turns into a NaN input gradient there
    (the row-parallel projection's input is tp-local: tp rank 0 is still finite)."""
    outcomes = run(_failed_step, 4, "gpt2", False, poison, {"tp": 2, "pp": 2})
    _check(outcomes, Layout(2, 2, 1), f"backward: {named}, micro-batch 0", *poison[2:])
    assert "step 2" in outcomes[0] and "non-finite gradients (norm nan)" in outcomes[0]


@pytest.mark.parametrize("options", [
    {"tp": 2, "pp": 2, "schedule": "gpipe", "recompute": "full", "sequence_parallel": True},
    {"tp": 2, "pp": 2, "schedule": "zb-h1", "precision": "bf16"},
    {"tp": 2, "pp": 2, "schedule": "interleaved", "virtual_stages": 2,
     "recompute": "selective"},
    {"cp": 2, "pp": 2, "zero": 1},
    {"tp": 2, "pp": 2, "precision": "fp16", "max_nonfinite_steps": 1},
], ids=["gpipe-sp-recompute", "zbh1-bf16", "interleaved", "cp2-zero1", "fp16"])
def test_the_location_holds_for_schedules_and_modes(run, options):
    outcomes = run(_failed_step, 4, "gpt2", True, None, options)
    layout = Layout(options.get("tp", 1), 2, 1, cp=options.get("cp", 1))
    tp = 1 if options.get("tp", 1) == 2 else 0  # at cp 2 every cp rank holds the inf: rank 0
    pp = 0 if "virtual_stages" in options else 1  # interleaved: blocks 0, 1, 2, 3 on pp 0, 1, 0, 1
    _check(outcomes, layout, "forward: output of transformer.h.2.mlp.c_fc, micro-batch 0", tp, pp)



def _token_rerun(pp):
    """--loss-mean token at `pp`, labels unevenly -100 (rows 2 and 3 wholly: one micro-batch
    has none): a good step, then one whose block-1 c_fc weight gradient is poisoned on pp
    stage 0. Every executor loss of the failed step and its re-run, the micro-batch mean of
    that step's batch, and the error."""
    engine = megapar.prepare(_model("gpt2"), pp=pp, micro_batch_size=2, lr=1e-3,
                             loss_mean="token")
    batch = _batch("gpt2")
    batch["labels"][torch.arange(SEQ)[None, :] < torch.arange(G)[:, None] * 2] = -100
    batch["labels"][2:4] = -100
    engine.train_step(batch)
    executor, losses = engine.executor_for(SEQ), []
    run_pipeline = executor.run

    def recorded(*args, **kwargs):
        losses.append(run_pipeline(*args, **kwargs).detach().clone())
        return losses[-1]

    executor.run = recorded
    if engine.mesh.pp_rank == 0:
        dict(engine.model.named_parameters())["layers.1.mlp.fc.weight"].register_hook(
            lambda g: g * float("nan"))
    try:
        engine.train_step(batch)
        message = "no error"
    except megapar.faults.stop.NonFiniteError as exc:
        message = str(exc)
    with torch.no_grad():
        micro_mean = run_pipeline(engine.split(batch), forward_only=True)
    return losses, micro_mean, message


def test_the_re_run_reproduces_the_token_mean_steps_loss(run):
    """--loss-mean token: the re-run weighs its micro-batches' losses with the failed step's
    weight (`KeptStep.loss_weight`), so its loss is the step's, bit for bit, on every rank;
    the micro-batch mean's is another number here."""
    _model("gpt2")  # transformers' GPT-2 imported here, once, not in each forked rank
    for losses, micro_mean, message in run(_token_rerun, 1, 1):
        assert "backward: weight gradient of transformer.h.1.mlp.c_fc" in message, message
        assert len(losses) == 2 and torch.equal(losses[0], losses[1]), losses
        assert abs(losses[0] / micro_mean - 1) > 1e-2, (losses, micro_mean)


def test_every_model_type_names_the_module_its_loss_is_reported_at():
    """`ModuleTrace` names the loss event after the model's head: it read the name from a table
    of GPT-2, Llama and BERT only (a KeyError for a Mixtral or a Qwen3-MoE); every model type
    megapar builds has one now."""
    from megapar.diagnostics.module_trace import LOSS_NAME
    from megapar.models import MODEL_CLASSES

    assert set(LOSS_NAME) == set(MODEL_CLASSES)
