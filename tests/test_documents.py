"""Packed documents (`megapar.models.documents`): block_causal attention with reset position ids
gives each document of a packed sequence the logits it has alone in transformers' model, and
(with --eod-mask-loss) a loss and gradients equal to the sum of the documents' own losses over
the labelled tokens; other layouts equal one process."""

import pytest
import torch
import transformers
from tp_utils import assert_close, make_mesh

from megapar.checkpoint import hf_names
from megapar.checkpoint.hf import HFReader, load_hf_weights
from megapar.models import GPT2, Llama
from megapar.models.documents import (
    document_ids,
    document_positions,
    mask_eod_labels,
    set_documents,
)

VOCAB, SEQ, EOD = 101, 16, 100
ROWS = [[5, 7, 4], [9, 7]]  # document lengths per row; every document but a row's last ends
# with the eod
GPT2_TINY = dict(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
LLAMA_TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  rms_norm_eps=1e-5, rope_theta=10000.0)
MODELS = {
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2_TINY)),
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA_TINY)),
    # a sliding window of 4 cutting the documents of up to 9 tokens: window AND documents
    "mistral": lambda: transformers.MistralForCausalLM(
        transformers.MistralConfig(**LLAMA_TINY, sliding_window=4)),
}


def _packed():
    """(input_ids [2, SEQ], each row's documents as (start, stop))."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, EOD, (len(ROWS), SEQ), generator=gen)
    spans = []
    for r, lengths in enumerate(ROWS):
        start, row = 0, []
        for j, n in enumerate(lengths):
            if j < len(lengths) - 1:
                ids[r, start + n - 1] = EOD
            row.append((start, start + n))
            start += n
        spans.append(row)
    return ids, spans


def test_document_ids_and_positions():
    ids = torch.tensor([[7, EOD, 3, 4, EOD, EOD, 9]])
    assert document_ids(ids, EOD).tolist() == [[0, 0, 1, 1, 1, 2, 3]]
    assert document_positions(ids, EOD).tolist() == [[0, 1, 0, 1, 2, 0, 0]]
    labels = torch.tensor([[EOD, 3, 4, EOD, EOD, 9, -100]])
    masked = mask_eod_labels({"input_ids": ids, "labels": labels}, EOD)["labels"]
    assert masked.tolist() == [[EOD, -100, 4, EOD, -100, -100, -100]]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_docs")
    out = {}
    for name, make in MODELS.items():
        torch.manual_seed(0)
        model = make()
        with torch.no_grad():  # non-trivial norms and biases, so a mapping mistake shows
            for key, p in model.named_parameters():
                if "norm" in key or "ln_" in key or key.endswith("bias"):
                    p.add_(torch.randn_like(p) * 0.1)
        model.save_pretrained(root / name)
        out[name] = str(root / name)
    return out


@pytest.mark.parametrize("name", list(MODELS))
def test_packed_documents_equal_each_alone(hf_dirs, name):
    """Per token, the logits of a packed sequence (block_causal, reset position ids) equal
    those of its document run alone through transformers' model (fp32, 1e-5); with
    --eod-mask-loss every document's tokens but its last are labelled, and the loss (the mean
    over them) and every gradient equal those of the documents' summed losses over that
    count."""
    path = hf_dirs[name]
    reader = HFReader(path)
    mesh = make_mesh()
    model = (GPT2 if name == "gpt2" else Llama)(reader.config, mesh)
    assert load_hf_weights(model, reader) == []
    set_documents(model, "block_causal", True, EOD)
    ids, spans = _packed()
    labels = torch.cat([ids[:, 1:], torch.full((len(ROWS), 1), -100)], dim=1)
    batch = mask_eod_labels({"input_ids": ids, "labels": labels}, EOD)

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    hf.eval()
    model.eval()
    with torch.no_grad():
        logits = model(None, {"input_ids": ids})
    total, count = 0.0, 0
    for r, row in enumerate(spans):
        for start, stop in row:
            doc = ids[r:r + 1, start:stop]
            out = hf(input_ids=doc, labels=doc)
            assert_close(logits[r, start:stop, :VOCAB], out.logits[0].detach(),
                         what=f"{name} logits of row {r} tokens {start}:{stop}")
            total = total + out.loss * (stop - start - 1)
            count += stop - start - 1
    assert int((batch["labels"] != -100).sum()) == count
    (total / count).backward()

    loss = model(None, batch)
    loss.backward()
    assert_close(loss, total.detach() / count, what=f"{name} loss")
    grads = {k: p.grad for k, p in hf.named_parameters() if p.grad is not None}

    def get(key):
        return grads[reader.prefix + key] if reader.prefix + key in grads else grads[key]

    canonical = hf_names.gpt2_canonical if name == "gpt2" else hf_names.llama_canonical
    for key, p in model.named_parameters():
        grad = p.grad[tuple(slice(0, n) for n in p.full_shape)]  # the vocab's padding cut
        assert_close(grad, canonical(key, get, reader.config), what=f"{name} grad of {key}")


def test_causal_is_unchanged_and_documents_change_it(hf_dirs):
    """The default (causal, positions from 0) is the model as before; block_causal changes the
    logits of every document after a row's first (so the test above tests something)."""
    reader = HFReader(hf_dirs["llama"])
    model = Llama(reader.config, make_mesh())
    assert load_hf_weights(model, reader) == []
    ids, spans = _packed()
    with torch.no_grad():
        plain = model(None, {"input_ids": ids})
        set_documents(model, "causal", False, EOD)
        assert torch.equal(model(None, {"input_ids": ids}), plain)
        set_documents(model, "block_causal", False, EOD)
        masked = model(None, {"input_ids": ids})
    first = spans[0][0][1]
    assert torch.equal(masked[0, :first], plain[0, :first])
    assert not torch.allclose(masked[0, first:], plain[0, first:])


@pytest.mark.parametrize("kind,window,masks", [("gpt2", None, 1), ("qwen2", 4, 2),
                                               ("qwen2", SEQ, 1)])
def test_the_planner_counts_the_masks_the_model_keeps(monkeypatch, kind, window, masks):
    """block_causal's additive masks as the real code makes them: one [b, 1, s, s] per
    micro-batch and sliding window the layers cut the sequence with (Qwen2 here: a full layer
    and two of the window; a window of s cuts nothing and shares the full layer's mask),
    shared by the layers, kept by the attention until the backward and freed by it; their
    bytes are the planner's (`plan.memory`: masks x b s^2 x 4 in fp32)."""
    import weakref

    from megapar.models import documents
    from megapar.models.config import config_from_dict
    from megapar.plan import memory as mem

    if kind == "gpt2":
        config = config_from_dict({"model_type": "gpt2", **GPT2_TINY})
    else:  # layer 0 full, layers 1 and 2 windowed (max_window_layers)
        config = config_from_dict({"model_type": "qwen2", **LLAMA_TINY, "num_hidden_layers": 3,
                                   "use_sliding_window": True, "sliding_window": window,
                                   "max_window_layers": 1})
    model = (GPT2 if kind == "gpt2" else Llama)(config, make_mesh())
    set_documents(model, "block_causal", False, EOD)
    made, real = [], documents.block_causal_bias

    def recorded(*args):
        bias = real(*args)
        made.append(weakref.ref(bias))
        return bias

    monkeypatch.setattr(documents, "block_causal_bias", recorded)
    ids, _ = _packed()
    labels = torch.cat([ids[:, 1:], torch.full((len(ROWS), 1), -100)], dim=1)
    loss = model(None, {"input_ids": ids, "labels": labels})
    alive = [r() for r in made]
    assert len(alive) == masks and all(t is not None for t in alive), "kept for the backward"
    layers = range(config.num_layers)
    assert mem.document_masks(config, layers, SEQ) == masks
    b = len(ROWS)
    assert sum(t.nbytes for t in alive) == masks * mem.document_mask_bytes(SEQ, b, 4)
    assert mem.document_mask_bytes(SEQ, b, 4) == b * SEQ * SEQ * 4  # [b, 1, s, s] fp32
    del alive
    loss.backward()  # freed by reference counts: no collection (slow in a large test process)
    assert all(r() is None for r in made), "freed by the backward"


def test_the_planner_adds_the_mask_per_micro_batch_in_flight(capsys):
    """megapar-plan under --attention-mask-type block_causal: each stage's activations grow by
    its micro-batches in flight x one mask (b x s x s x 2 bytes in bf16: 128 MiB at 8,192
    tokens); a chunk counts its own (interleaved: every chunk's micro-batches); under cp by the
    ring the masks are per kernel call, transient buffers, and the a2a keeps the whole one."""
    import dataclasses

    from megapar.models.recipes import resolve_model
    from megapar.plan import Candidate, Problem, stage_memory
    from megapar.plan.context_parallel import cp_document_call_bytes
    from megapar.plan.memory import document_mask_bytes

    assert document_mask_bytes(8192, 1, 2) == 128 * 2**20
    config = resolve_model("gpt2-tiny")
    causal = Problem(config, 4, global_batch=8, seq_len=64, precision="bf16")
    block = dataclasses.replace(causal, attention_mask_type="block_causal")
    mask = 2 * 64 * 64 * 2
    for c, chunks in ((Candidate(1, 2, 1, 2), 1), (Candidate(1, 2, 1, 1, "interleaved", 2), 2)):
        for before, after in zip(stage_memory(causal, c), stage_memory(block, c)):
            assert after.activations - before.activations == before.in_flight * chunks * (
                mask if c.mbs == 2 else mask // 2), (c, before.stage)
            assert after.buffers == before.buffers
    ring = Candidate(1, 1, 2, 2, cp=2, cp_comm="p2p")
    (before,), (after,) = stage_memory(causal, ring), stage_memory(block, ring)
    assert after.activations == before.activations
    assert after.buffers - before.buffers == cp_document_call_bytes(64, 2, 2, 2) == 2 * 16 * 32 * 3
    a2a = dataclasses.replace(ring, cp_comm="a2a")
    (before,), (after,) = stage_memory(causal, a2a), stage_memory(block, a2a)
    assert after.activations - before.activations == before.in_flight * mask
    # megapar-plan takes the flag, says how it counts the mask, and hands the flag on
    from megapar.cli.plan import main as plan_main

    assert plan_main(["--model", "gpt2-tiny", "--gpus", "2", "--global-batch-size", "8",
                      "--seq-len", "64", "--attention-mask-type", "block_causal",
                      "--explain", "tp=1,pp=2,mbs=2"]) == 0
    out = capsys.readouterr().out
    assert "block_causal: its additive mask (micro-batch x 64 x 64, 2 bytes an element)" in out
    assert "--seq-len 64 --attention-mask-type block_causal --micro-batch-size 2" in out, out
    # --verify's dry runs rehearse the masks too; BERT is refused as megapar-train refuses it
    from megapar.dryrun.verify import train_config

    cfg = train_config(block, Candidate(1, 2, 1, 2))
    assert cfg.attention_mask_type == "block_causal" and cfg.eod_id is not None
    assert plan_main(["--model", "bert-tiny", "--gpus", "2", "--global-batch-size", "8",
                      "--seq-len", "64", "--attention-mask-type", "block_causal"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "BERT's samples are one sentence pair each" in err[0], err


# --- layouts equal one process -------------------------------------------------------------
G, STEPS = 4, 3
LAYOUTS = {  # name: (model, prepare's layout keywords)
    "tp2_pp2_sp_full": ("mistral", dict(tp=2, pp=2, sequence_parallel=True, recompute="full")),
    "dp2_zero3": ("mistral", dict(zero=3)),
    "cp2_a2a_selective": ("mistral", dict(cp=2, cp_comm_type="a2a", recompute="selective")),
    "gpt2_tp2_pp2_interleaved_sp": ("gpt2", dict(tp=2, pp=2, schedule="interleaved",
                                                 virtual_stages=2, micro_batch_size=1,
                                                 sequence_parallel=True)),
    # the all-gather (Mistral's grouped-query default) and the ring mask each kernel call
    "cp2_all_gather": ("mistral", dict(cp=2)),
    "tp2_cp2_ring_sp": ("mistral", dict(tp=2, cp=2, cp_comm_type="p2p", sequence_parallel=True)),
    # positions alone need no mask
    "cp2_ring_positions_only": ("mistral", dict(cp=2, cp_comm_type="p2p",
                                                attention_mask_type="causal")),
}
PARITY_MODELS = {  # 4 layers (interleaved pp 2 x 2 chunks); Mistral's window of 6 cuts SEQ
    "gpt2": lambda: transformers.GPT2Config(**{**GPT2_TINY, "n_layer": 4}),
    "mistral": lambda: transformers.MistralConfig(**{**LLAMA_TINY, "num_hidden_layers": 4},
                                                  sliding_window=6),
}


def _global_batches() -> list[dict]:
    """STEPS global batches of G packed rows, documents of 1 to 8 tokens ended by the eod."""
    gen = torch.Generator().manual_seed(5)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, EOD, (G, SEQ + 1), generator=gen)
        ids[torch.rand(G, SEQ + 1, generator=gen) < 0.2] = EOD
        out.append({"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()})
    return out


def _train(kind: str, layout: dict) -> list[float]:
    import megapar

    torch.manual_seed(0)
    options = {"micro_batch_size": 2, "attention_mask_type": "block_causal", **layout}
    engine = megapar.prepare(PARITY_MODELS[kind](), lr=3e-3, weight_decay=0.1, clip_grad=0.3,
                             seed=4, reset_position_ids=True, eod_mask_loss=True, eod_id=EOD,
                             loss_mean="token", **options)
    batches = _global_batches()
    losses = [engine.train_step(b) for b in batches]
    return losses + [engine.eval_step(batches[0])]  # the weights after the last step


@pytest.fixture(scope="module")
def one_process():
    """`reference(kind, mask type)`: one process's losses, computed once each."""
    done = {}

    def reference(kind, mask):
        if (kind, mask) not in done:
            done[kind, mask] = _train(kind, {"attention_mask_type": mask})
        return done[kind, mask]

    return reference


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layouts_equal_one_process(run, one_process, name):
    """Three steps (AdamW, clipping) and an evaluation after them give one process's losses
    (fp32, 1e-5; the token mean, the same at any micro-batch size) with block_causal, reset
    position ids and --eod-mask-loss, at tp 2 x pp 2 (sequence parallelism, full recompute),
    dp 2 with ZeRO-3, cp 2 by the all-to-all (selective recompute), cp 2 by the all-gather,
    tp 2 x cp 2 by the ring (sequence parallelism) and GPT-2 at tp 2 x pp 2 interleaved (SP);
    reset position ids alone at cp 2 by the ring."""
    kind, layout = LAYOUTS[name]
    world = layout.get("tp", 1) * layout.get("pp", 1) * layout.get("cp", 1)
    world *= 2 if layout.get("zero") else 1
    results = run(_train, world, kind, layout)
    want_losses = one_process(kind, layout.get("attention_mask_type", "block_causal"))
    for losses in results:
        for step, (got, want) in enumerate(zip(losses, want_losses)):
            assert_close(torch.tensor(got), torch.tensor(want), what=f"{name} loss {step}")


def test_the_resume_line_names_a_change_of_the_document_flags():
    """A --load run given --attention-mask-type, --reset-position-ids or --eod-mask-loss other
    than the checkpoint's run says so on its resume line, as it names a ZeRO change (flags not
    given are the checkpoint's: no change to name)."""
    from megapar.training.config import TrainConfig
    from megapar.training.resume import setting_changes

    trained = dict(attention_mask_type="block_causal", reset_position_ids=True,
                   eod_mask_loss=True)
    saved = TrainConfig(zero=2, **trained).to_dict()
    now = TrainConfig(zero=0, attention_mask_type="causal", reset_position_ids=True)
    assert setting_changes(saved, now) == (
        "; --zero 2 -> 0; --attention-mask-type block_causal -> causal; --eod-mask-loss on -> off")
    assert setting_changes(TrainConfig().to_dict(), TrainConfig(reset_position_ids=True)) == (
        "; --reset-position-ids off -> on")
    assert setting_changes(saved, TrainConfig(zero=2, **trained)) == ""
    assert setting_changes({}, now) == ""  # a checkpoint that recorded no settings


# --- megapar-train end to end --------------------------------------------------------------
def test_megapar_train_packs_documents_alike_at_two_layouts(tmp_path, capsys, monkeypatch):
    """megapar-train on the shipped Shakespeare sample cut into short documents (a JSON Lines
    record each): --attention-mask-type block_causal --reset-position-ids --eod-mask-loss (the
    eod id the tokenizer's) train 3 steps of a tiny Llama at pp 2 and at tp 2 x cp 2 (the
    all-gather of its grouped-query heads) with the same losses (fp32, 1e-5), which differ from
    the run without them. megapar-eval of the checkpoint (at tp 2) evaluates as it trained:
    its loss is each document of each window run alone through the model (positions from 0,
    no eod position labelled), and it says which settings it applies; `load_model` returns
    them, its manifest read once."""
    import json
    from pathlib import Path

    from megapar.cli.train import main
    from megapar.data import asset_path

    text = Path(asset_path("shakespeare_sample.txt")).read_text()[:30_000]
    docs = [p.strip() for p in text.split("\n\n") if p.strip()]
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    model = tmp_path / "llama.json"
    model.write_text(json.dumps({"model_type": "llama", "hidden_size": 32,
                                 "intermediate_size": 64, "num_hidden_layers": 2,
                                 "num_attention_heads": 4, "num_key_value_heads": 2,
                                 "max_position_embeddings": 64}))
    common = ["--model", str(model), "--data", str(data), "--tokenizer", "sentencepiece",
              "--data-cache", str(tmp_path / "cache"), "--seq-len", "32",
              "--micro-batch-size", "2", "--global-batch-size", "4", "--max-steps", "3",
              "--lr", "3e-3", "--log-interval", "1", "--eval-interval", "0", "--no-progress",
              "--warmup-steps", "1"]
    flags = ["--attention-mask-type", "block_causal", "--reset-position-ids", "--eod-mask-loss"]

    def losses(*args):
        log = tmp_path / f"log{len(list(tmp_path.glob('log*')))}.jsonl"
        assert main([*common, *args, "--log-json", str(log)]) == 0
        return [json.loads(line)["loss"] for line in log.read_text().splitlines()]

    pp2 = losses("--pp", "2", *flags, "--save", str(tmp_path / "ckpt"))
    cp2 = losses("--tp", "2", "--cp", "2", *flags)  # the all-gather: grouped-query heads
    plain = losses("--pp", "2")
    assert len(pp2) == 3
    for a, b in zip(pp2, cp2):
        assert abs(a - b) <= 1e-5 * abs(b), (pp2, cp2)
    assert all(abs(a - b) > 1e-3 for a, b in zip(pp2, plain)), (pp2, plain)

    from megapar.cli.eval import main as evaluate
    from megapar.data import GPTDataset, IndexedDataset
    from megapar.training.inference import load_model

    capsys.readouterr()
    assert evaluate(["--load", str(tmp_path / "ckpt"), "--tp", "2", "--data", str(data),
                     "--data-cache", str(tmp_path / "cache"), "--seq-len", "32",
                     "--micro-batch-size", "2", "--max-batches", "2"]) == 0
    said = capsys.readouterr()
    report = json.loads(said.out.strip().splitlines()[-1])
    eod_said = json.loads(next((tmp_path / "ckpt").rglob("manifest.json")).read_text())[
        "meta"]["train_config"]["eod_id"]
    assert ("megapar-eval: evaluates as the checkpoint's run trained: --attention-mask-type "
            "block_causal, --reset-position-ids, --eod-mask-loss (end-of-document id "
            f"{eod_said})") in said.err, said.err
    (prefix,) = {str(p.with_suffix("")) for p in (tmp_path / "cache").rglob("*.idx")}
    windows = GPTDataset(IndexedDataset(prefix), 32)
    _, config, model, none = load_model(str(tmp_path / "ckpt"), 1, 1)  # causal, from 0
    eod = json.loads(next((tmp_path / "ckpt").rglob("manifest.json")).read_text())[
        "meta"]["train_config"]["eod_id"]
    from megapar.training import inference

    reads = []
    monkeypatch.setattr(inference, "read_manifest",
                        lambda path, real=inference.read_manifest: reads.append(path) or real(path))
    loaded = load_model(str(tmp_path / "ckpt"), 1, 1, documents=True)
    assert none == {} and len(reads) == 1, reads
    assert loaded.documents == {"attention_mask_type": "block_causal", "reset_position_ids": True,
                                "eod_mask_loss": True, "eod_id": eod}
    nll, labelled, documents = 0.0, 0, 0
    with torch.no_grad():
        for i in range(4):
            ids, labels = windows[i]["input_ids"], windows[i]["labels"]
            ends = [j + 1 for j in range(len(ids)) if int(ids[j]) == eod]
            for start, stop in zip([0, *ends], [*ends, len(ids)]):
                if start == stop:
                    continue
                documents += 1
                logits = model(None, {"input_ids": ids[None, start:stop]})[0, :, :config.vocab_size]
                keep = (labels[start:stop] != -100) & (ids[start:stop] != eod)
                nll += float(torch.nn.functional.cross_entropy(
                    logits[keep], labels[start:stop][keep], reduction="sum"))
                labelled += int(keep.sum())
    assert documents > 4 and report["tokens"] == labelled, (report, labelled, documents)
    assert abs(report["loss"] - nll / labelled) <= 1e-5 * nll / labelled, (report, nll / labelled)


@pytest.mark.parametrize("argv, said", [
    (["--model", "bert-tiny", "--eod-mask-loss"],
     "--eod-mask-loss reads the documents packed into a decoder's sequences, and BERT's"),
    (["--eod-id", "3"], "--eod-id 3 would be ignored"),
    (["--reset-attention-mask"], "did you mean --attention-mask-type block_causal?"),
    (["--model.attn_mask_type", "block_causal"], "did you mean --attention-mask-type?"),
])
def test_megapar_train_refuses_in_one_line(capsys, argv, said):
    """What cannot run is refused before any worker starts: one line, exit 2; Megatron-LM's
    and torchtitan's names are answered with megapar's flag."""
    from megapar.cli.train import main

    with pytest.raises(SystemExit) as exc:
        code = main(argv)
        raise SystemExit(code)
    err = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(err) == 1 and said in err[0], err


def test_megapar_train_says_when_the_documents_flags_change_little(tmp_path, capsys):
    """A run that reads documents says, before it starts, when its settings likely miss: the
    data is one text tokenized whole (a document many times --seq-len: few sequences hold a
    boundary), fine-tuning records (one sample each: nothing changes), or --eod-id is not the
    data's tokenizer's end-of-document token; each part of a blended --data is checked (here
    the second); a dry run says how its modelled activations count the block_causal mask (its
    size)."""
    import json
    from pathlib import Path

    from megapar.cli.data import main as data_main
    from megapar.cli.train import main
    from megapar.data import IndexedDataset, asset_path
    from megapar.training.documents import document_notes

    text = tmp_path / "one.txt"
    text.write_text(Path(asset_path("shakespeare_sample.txt")).read_text()[:6_000])
    prefix = str(tmp_path / "one")
    assert data_main(["--input", str(text), "--output-prefix", prefix,
                      "--tokenizer", "sentencepiece"]) == 0
    indexed = IndexedDataset(prefix)
    assert indexed.num_docs == 1 and indexed.num_tokens > 10 * 32
    short = tmp_path / "short.jsonl"  # a blend's first part of short documents: nothing to say
    short.write_text("".join(json.dumps({"text": f"document {i} is short."}) + "\n"
                             for i in range(40)))
    assert data_main(["--input", str(short), "--output-prefix", str(tmp_path / "short"),
                      "--tokenizer", "sentencepiece"]) == 0
    blend = ["1", str(tmp_path / "short"), "1", prefix]
    model = tmp_path / "llama.json"
    model.write_text(json.dumps({"model_type": "llama", "hidden_size": 32,
                                 "intermediate_size": 64, "num_hidden_layers": 1,
                                 "num_attention_heads": 4, "max_position_embeddings": 64}))
    capsys.readouterr()
    assert main(["--model", str(model), "--data", *blend, "--seq-len", "32", "--max-steps", "1",
                 "--global-batch-size", "4", "--micro-batch-size", "4", "--val-fraction", "0",
                 "--attention-mask-type", "block_causal", "--eod-mask-loss",
                 "--eod-id", "5", "--dry-run", "--world-size", "1"]) == 0
    err = capsys.readouterr().err
    assert (f"--data's part {prefix} holds 1 document of {indexed.num_tokens:,} tokens, at least "
            f"10 x --seq-len 32: few sequences hold two documents, so --attention-mask-type "
            f"block_causal, --eod-mask-loss change little") in err, err
    assert err.count("few sequences hold two documents") == 1, err  # not the short part
    assert (f"--eod-id 5 is not the end-of-document token of --data {' '.join(blend)}'s "
            f"tokenizer ({indexed.eod_id}, which ends each of its documents)") in err, err
    # the dry run names the mask its modelled activations count (4 x 32 x 32 fp32)
    assert ("dry run: --attention-mask-type block_causal's mask (4 x 32 x 32, 16.00 KiB per "
            "micro-batch in flight and sliding window on a model chunk;") in err, err
    assert "is counted in the modelled activations below, as megapar-plan counts it" in err

    class Cfg:
        attention_mask_type, reset_position_ids, eod_mask_loss, seq_len = "causal", True, False, 8
        eod_id = None

    # documents shorter than 10 x --seq-len, and the data's own eod: nothing to say
    assert document_notes(Cfg, 2, [("--data d", 10, 799)], "--data d") == []
    assert document_notes(Cfg, 2, [("--data d", 10, 800)], "--data d") == [
        "--data d holds 10 documents of 80 tokens on average, at least 10 x --seq-len 8: few "
        "sequences hold two documents, so --reset-position-ids changes little (a text tokenized "
        "whole is one document: megapar-data --split-lines, or a .jsonl of one record per "
        "document, keeps them apart)"]
    # fine-tuning records: one right-padded sample each, whatever their lengths
    assert document_notes(Cfg, 2, [("--data d", 10, 50)], "--data d", records=True) == [
        "--data d holds fine-tuning records (--sft-keys), one right-padded sample each: no "
        "sequence holds two documents, so --reset-position-ids changes nothing (drop it)"]
