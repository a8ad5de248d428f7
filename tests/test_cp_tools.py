"""megapar-plan and megapar-bubble know context parallelism: the plan's memory is what a cp
rank really keeps, its communication what cp attention really sends, and it offers cp layouts
for long sequences; megapar-bubble measures a pipeline whose stages run on cp ranks."""

import json

import torch
import torch.distributed as dist
from tp_utils import saved_bytes

from megapar.cli.plan import main as plan_main
from megapar.launcher import run_local
from megapar.mesh import Layout, Mesh
from megapar.models import GPT2Config, build_model
from megapar.plan import Candidate, Problem, check, parse_candidate, stage_memory
from megapar.plan import memory as mem
from megapar.plan.context_parallel import cp_traffic

S, B, H, HEADS = 32, 3, 32, 4


def _saved_at_cp2():
    """Bytes a middle stage (2 GPT-2 layers) keeps for backward on this cp rank."""
    config = GPT2Config(
        vocab_size=300,
        n_positions=S,
        n_embd=H,
        n_layer=2,
        n_head=HEADS,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = build_model(config, Mesh(Layout(cp=2), dist.get_rank()), range(2), False, False)
    model.init_weights(0)
    hidden = torch.randn(B, S // 2, H, requires_grad=True)
    saved, out = saved_bytes(model, lambda: model(hidden, {}))
    return saved + out.untyped_storage().nbytes()


def test_cp_activation_prediction_equals_bytes_a_cp_rank_saves():
    """The planner's per-layer count of s / cp tokens, with the log-sum-exp of cp attention in
    place of the scores, is what each cp rank's forward keeps (fp32, no dropout)."""
    predicted = (
        2
        * mem.layer_bytes(
            S // 2, B, H, HEADS, act_bytes=4, dropout=False, fused_attention=True, norm_stats=True
        )
        + S // 2 * B * H * 4
    )
    for held in run_local(_saved_at_cp2, 2):
        assert held == predicted
    config = GPT2Config(
        vocab_size=300,
        n_positions=S,
        n_embd=H,
        n_layer=2,
        n_head=HEADS,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    problem = Problem(config, 2, 8, 80, B, S, "fp32", "fp32")  # not fused: cp implies it
    at_cp2 = stage_memory(problem, Candidate(mbs=B, cp=2))[0].activations
    at_cp1 = stage_memory(
        Problem(config, 1, 8, 80, B, S // 2, "fp32", "fp32", fused_attention=True), Candidate(mbs=B)
    )[0].activations
    assert at_cp2 == at_cp1  # a cp 2 rank's stage holds what cp 1 holds for half the tokens


def test_cp_traffic_is_what_cp_attention_sends():
    """Per layer and micro-batch, the planner's cp traffic equals the calls counted in a real
    step (tests/test_comm_counts.py's cp step at tp 1, cp 2): ring sends for GPT-2 and BERT,
    all-gathers and a reduce-scatter for grouped-query Llama; under --cp-comm-type a2a the two
    all-to-alls each way (q, k and v together, the output) for GPT-2 and Llama (its 2 kv heads
    unexpanded)."""
    import test_comm_counts as counts

    from megapar.comm_count import summary

    runs = [(kind, "none") for kind in ("gpt2", "bert", "llama")]
    runs += [("gpt2", "none", "a2a"), ("llama", "none", "a2a")]
    results = run_local(counts._cp_worker, 2, 1, 2, False, runs)[0]
    names = {
        "send": "isend",
        "all-gather": "all_gather_into_tensor",
        "reduce-scatter": "reduce_scatter_tensor",
        "all-to-all": "all_to_all_single",
    }
    for (kind, _, *comm), (calls, _) in zip(runs, results):
        config = counts.CONFIG_CLASSES[kind](**counts.CONFIGS[kind])
        problem = Problem(config, 2, 8, 80, counts.MBS * counts.M, counts.SEQ, "fp32")
        c = Candidate(mbs=counts.MBS, cp=2, cp_comm=comm[0] if comm else "auto")
        planned = {}
        for op, n, nbytes in cp_traffic(problem, c)["forward"] + cp_traffic(problem, c)["backward"]:
            key = (names[op], nbytes // 4, 2)
            planned[key] = planned.get(key, 0) + n * counts.L * counts.M
        counted = {k: v for k, v in summary(calls).items() if k[0] in names.values()}
        assert counted == planned and planned, (kind, comm)


def test_plan_offers_cp_for_long_sequences_and_checks_the_split(capsys):
    args = [
        "--model",
        "llama-8b",
        "--gpus",
        "64",
        "--global-batch-size",
        "64",
        "--schedules",
        "1f1b",
        "--micro-batch-sizes",
        "1",
        "--json",
    ]

    assert plan_main(args + ["--seq-len", "131072"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert "--cp " in out["command"]
    assert any(" cp" in row["layout"] for row in out["layouts"])
    assert plan_main(args + ["--seq-len", "2048"]) == 0  # short: cp not tried unless asked
    out = json.loads(capsys.readouterr().out)
    assert not any(" cp" in row["layout"] for row in out["layouts"])
    config = GPT2Config(n_layer=4, n_head=16, n_embd=1024)
    c = parse_candidate("tp=2,cp=4", 8)
    assert c.dp == 1 and parse_candidate(c.spec()) == c
    assert "not divisible by 8: --cp 4" in check(c, Problem(config, 8, global_batch=16, seq_len=100))
    assert check(c, Problem(config, 8, global_batch=16, seq_len=128)) is None
    assert check(parse_candidate("cp=2,zero=1", 2),
                 Problem(config, 2, global_batch=16, seq_len=128)) is None


def test_bubble_measures_a_pipeline_of_cp_ranks(capsys):
    """megapar-bubble --cp 2: each stage on 2 ranks (half the tokens each): the activations a
    stage holds are half of cp 1's (all but the loss's weight gradient, per step not token), and a bad --seq-len is refused before any worker starts."""
    from megapar.cli.bubble import main as bubble_main

    base = [
        "--pp",
        "2",
        "-m",
        "2",
        "--model",
        "gpt2-tiny",
        "--seq-len",
        "64",
        "--steps",
        "1",
        "--micro-batch-size",
        "2",
    ]
    runs = {}
    for cp in (1, 2):
        assert bubble_main(base + ["--cp", str(cp)]) == 0
        out = capsys.readouterr().out
        runs[cp] = json.loads(out.strip().splitlines()[-1])
        assert ("cp=2" in out) == (cp == 2)
    # the last stage's chunked loss (tp 1, 1F1B: one loss in flight) holds the head's fp32
    # weight gradient from its forward to its backward: [vocab, h], the same at any cp
    from megapar.models.recipes import resolve_model
    from megapar.tensor_parallel.partition import local_size

    c = resolve_model("gpt2-tiny")
    weight_grad = [0.0, local_size(c.vocab_size, 1, c.make_vocab_size_divisible_by)
                   * c.hidden_size * 4 / 2**20]
    for stage in range(2):
        tokens = [runs[cp]["activation_mb"][stage] - weight_grad[stage] for cp in (1, 2)]
        ratio = tokens[1] / tokens[0]
        assert 0.4 < ratio < 0.6, (stage, ratio)
    assert bubble_main(base[:-6] + ["--cp", "2", "--seq-len", "30"]) == 2
    assert "not divisible by 4: --cp 2" in capsys.readouterr().err
