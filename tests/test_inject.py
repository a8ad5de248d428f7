"""The fault injector (`--inject-corrupt`, a testing tool): one value of one module's output on
one rank at one step, and only there."""

import math

import pytest
import torch

import megapar
from megapar.diagnostics import inject
from megapar.mesh import Layout
from megapar.models.config import GPT2Config

VOCAB, SEQ, G = 96, 16, 8
SPEC = "step=3,module=transformer.h.3.attn,tp=1"


def _gpt2():
    from transformers import GPT2Config as HFConfig

    return HFConfig(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=4, n_head=4,
                    resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None,
                    eos_token_id=None)


def _batch(i):
    x = torch.randint(0, VOCAB, (G, SEQ), generator=torch.Generator().manual_seed(i))
    return {"input_ids": x, "labels": (x * 3 + 1) % VOCAB}


def _train(spec, steps=3, value_spec=""):
    engine = megapar.prepare(_gpt2(), tp=2, pp=2, micro_batch_size=2, lr=1e-3,
                             inject_corrupt=spec + value_spec)
    losses, error = [], ""
    try:
        for i in range(steps):
            losses.append(engine.train_step(_batch(i)))
    except megapar.faults.stop.NonFiniteError as exc:
        error = str(exc)
    return losses, error, engine.injector.fired if engine.injector else 0


def test_the_corrupted_value_stops_the_run_at_its_step_named_where_it_was_put(run):
    """nan in block 3's attention output on tp rank 1 at step 3 (tp 2 x pp 2): steps 1 and 2
    train, step 3 raises naming that module, micro-batch 0 and the rank; only that rank fired
    (in the step and in its re-run)."""
    results = run(_train, 4, SPEC)
    rank = Layout(2, 2, 1).rank(1, 1, 0)
    for r, (losses, error, fired) in enumerate(results):
        assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
        assert error.startswith("training diverged at step 3: non-finite loss (nan)"), error
        assert (f"forward: output of transformer.h.3.attn, micro-batch 0, rank {rank} "
                f"(tp=1 cp=0 pp=1 dp=0)") in error, error
        assert fired == (2 if r == rank else 0)


def test_a_finite_corruption_changes_the_loss_of_its_step_only(run):
    """value=1e3 at step 2: step 1's loss is the clean run's to the bit (the runs are
    deterministic), step 2's differs (by about 1e-5 relative: one value of one token, then a
    LayerNorm)."""
    clean = run(_train, 4, "", 2)[0][0]
    hit = run(_train, 4, "step=2,module=transformer.h.3.attn,tp=1,value=1e3", 2)[0][0]
    assert hit[0] == clean[0] and abs(hit[1] - clean[1]) > 1e-6 * clean[1], (clean, hit)


def test_specs_are_checked_with_one_line():
    config = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=4, n_head=4)
    layout = Layout(2, 2, 1)
    spec = inject.check(SPEC + ",value=-inf,mb=1,index=5", config, layout, 2)
    assert (spec.step, spec.module, spec.tp, spec.pp, spec.mb, spec.index, spec.value) == \
        (3, "transformer.h.3.attn", 1, None, 1, 5, -math.inf)
    for bad, message in [
        ("step=3,module=transformer.h.3.mlp.fc", "did you mean transformer.h.3.mlp.c_fc"),
        ("step=3,module=transformer.h.9.attn", "no module 'transformer.h.9.attn'"),
        ("step=0,module=transformer.h.3.attn", "step must be >= 1"),
        ("step=3,module=transformer.h.3.attn,cp=1", "cp=1 is outside the layout's cp 1"),
        ("step=3,module=transformer.h.3.attn,mb=2", "mb=2 but each rank runs 2 micro-batches"),
        ("step=3,modul=transformer.h.3.attn", "'modul=transformer.h.3.attn' is not KEY=VALUE"),
    ]:
        with pytest.raises(ValueError, match=message.replace(".", r"\.")):
            inject.check(bad, config, layout, 2)


def test_the_environment_holds_the_spec_when_the_flag_does_not(monkeypatch):
    monkeypatch.setenv(inject.ENV, SPEC)
    assert inject.from_settings(None) == SPEC
    assert inject.from_settings("step=1,module=x") == "step=1,module=x"


def test_a_module_that_makes_no_output_is_refused_not_passed():
    """An untied LM head is a holder of the weight the fused loss takes, and a BERT's
    cls.predictions is called only in parts: --inject-corrupt on either corrupted nothing and
    the run passed (a re-test). The head is refused before the run, naming its input; a module
    whose hook did not fire in its step stops the run."""
    from types import SimpleNamespace

    from megapar.faults.stop import RunStopped
    from megapar.mesh import Mesh
    from megapar.models.config import LlamaConfig
    from megapar.pipeline.partition import build_stage

    llama = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        tie_word_embeddings=False)
    with pytest.raises(ValueError, match="lm_head has no forward in megapar: .* corrupt the "
                                         "module before it, model.norm$"):
        inject.check("step=1,module=lm_head", llama, Layout(1, 1, 1))
    mesh = Mesh.virtual(Layout(1, 1, 1))
    stage = build_stage(llama, mesh, seed=0, init=False)
    spec = inject.check("step=2,module=model.norm", llama, Layout(1, 1, 1))
    injector = inject.CorruptInjector(spec, stage, llama, mesh)
    executor = SimpleNamespace(handlers={})
    with injector.armed(executor, 1):  # another step: nothing expected
        pass
    with pytest.raises(RunStopped, match="model.norm made no output in micro-batch 0 of step 2"):
        with injector.armed(executor, 2):
            pass  # a step that never calls the module


def test_a_module_output_that_is_no_view_is_corrupted_at_its_index():
    # a Qwen3 q_norm's output (its heads transposed) failed "view size is not compatible"
    # (a re-test): the value at the flat index of the output as it is laid out logically
    from megapar.mesh import Mesh
    from megapar.models.config import LlamaConfig
    from megapar.pipeline.partition import build_stage

    llama = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    mesh = Mesh.virtual(Layout(1, 1, 1))
    spec = inject.check("step=2,module=model.norm,index=5", llama, Layout(1, 1, 1))
    injector = inject.CorruptInjector(spec, build_stage(llama, mesh, seed=0, init=False), llama,
                                      mesh)
    injector.current = ("forward", 0)
    out = torch.arange(12.0).reshape(3, 4).t()  # 4 x 3, not contiguous
    corrupted = injector._hook(None, (), out)
    assert math.isnan(corrupted[1, 2]) and corrupted.stride() == out.stride()
    assert torch.equal(corrupted.isnan(), torch.zeros(4, 3, dtype=torch.bool).index_put_(
        (torch.tensor(1), torch.tensor(2)), torch.tensor(True)))
