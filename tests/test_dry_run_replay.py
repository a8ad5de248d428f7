"""The dry run's replayed layers (`megapar.dryrun.replay`): a rank rehearsed with the layers
between a stack's first and last replayed reports what it reports with every layer run."""

import pytest
from recipe_layers import with_layers

from megapar.dryrun import dry_run, replay, watch
from megapar.mesh import Layout
from megapar.models.config import config_from_dict
from megapar.training.config import TrainConfig

CASES = [  # (recipe, layers, layout (tp, pp, dp, cp, ep), ranks, TrainConfig options)
    pytest.param("llama-tiny", 3, (2, 1, 2, 1, 1), [3],
                 dict(sequence_parallel=True, recompute="full", zero=1, precision="bf16"),
                 id="llama-tp2-sp-full-zero1-bf16"),
    pytest.param("gpt2-tiny", 3, (1, 1, 1, 2, 1), [1],
                 dict(recompute="selective"), id="gpt2-cp2-selective"),
    pytest.param("llama-tiny", 12, (1, 2, 1, 1, 1), [1],
                 dict(schedule="interleaved", virtual_stages=2, zero=2),
                 id="llama-pp2-interleaved-zero2"),
    pytest.param("mixtral-tiny", 3, (2, 1, 2, 1, 2), [3],
                 dict(expert_tensor_parallel_size=2, recompute="full", zero=1),
                 id="mixtral-ep2-etp2-full"),
    pytest.param("llama-tiny", 6, (1, 2, 1, 1, 1), [1], dict(schedule="zb-h1"),
                 id="llama-zb-h1-not-replayed"),
]


@pytest.mark.parametrize("recipe,layers,layout,ranks,options", CASES)
def test_replayed_layers_report_what_every_layer_run_reports(monkeypatch, recipe, layers,
                                                            layout, ranks, options):
    tp, pp, dp, cp, ep = layout
    config = config_from_dict(with_layers(recipe, layers))
    cfg = TrainConfig(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, seq_len=16, micro_batch_size=1,
                      global_batch_size=2 * pp * dp, grad_bucket_mb=0.05, **options)
    mesh = Layout(tp, pp, dp, cp=cp, ep=ep)
    replayed = []
    apply = replay._Replay.apply
    monkeypatch.setattr(replay._Replay, "apply",
                        staticmethod(lambda *a: replayed.append(1) or apply(*a)))
    fast = [r.to_json() for r in dry_run(cfg, config, mesh, ranks)]
    monkeypatch.setattr(watch, "replay_layers", lambda *a: lambda: None)
    full = [r.to_json() for r in dry_run(cfg, config, mesh, ranks)]
    assert fast == full
    # zero-bubble's deferred weight gradients: never replayed; elsewhere every rank replays
    assert bool(replayed) == (options.get("schedule") != "zb-h1")
