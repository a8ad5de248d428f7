"""Llama built from tp layers equals transformers' LlamaForCausalLM: logits, loss, gradients.

Grouped-query attention with 4 query heads and 2 key/value heads, tied and untied head, Llama 3
rope scaling, at tp in {1, 2, 4} (tp 4 > 2 kv heads: k / v replicated) and pp in {1, 2}. The
model is loaded from a seeded transformers checkpoint; at pp 2 the loss and gradients come
through the pipeline executor (1F1B, two micro-batches) and the tied-embedding sync. The dense
families of Llama's layout equal their transformers classes the same way at 1 x 1 and 2 x 2:
Qwen3 (q / k norms, a head_dim other than hidden / heads, tied), Qwen2 (q / k / v biases;
at tp 4 too, where k / v and their biases are replicated; a sliding window of 8 on its second
layer, by max_window_layers) and Mistral (a sliding window of 8 in every layer), windows half
the sequence: the window's convention is transformers'.
"""

import pytest
import torch
import torch.distributed as dist
import transformers
from canonical import gather_canonical
from tp_utils import assert_close, make_mesh

from megapar.checkpoint.hf import (
    HFReader,
    load_hf_weights,
    save_hf,
)
from megapar.checkpoint.hf_names import llama_canonical
from megapar.launcher import run_local
from megapar.models import Llama, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config
from megapar.pipeline.executor import PipelineExecutor
from megapar.pipeline.partition import stage_spec
from megapar.pipeline.tied import sync_tied_embeddings
from megapar.tensor_parallel.partition import gather_full
from megapar.tensor_parallel.sequence_parallel import sync_sequence_parallel_grads

VOCAB, SEQ, B = 101, 16, 4
TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            rms_norm_eps=1e-5, rope_theta=500000.0)
LLAMA3_ROPE = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=16)


FAMILIES = {  # the dense families of Llama's layout: transformers' config, what it adds to TINY
    "qwen3": (transformers.Qwen3Config, dict(head_dim=16, tie_word_embeddings=True)),
    "qwen2": (transformers.Qwen2Config, dict(rope_theta=1e6, use_sliding_window=True,
                                             sliding_window=SEQ // 2, max_window_layers=1)),
    "mistral": (transformers.MistralConfig, dict(sliding_window=SEQ // 2)),
}


def _hf_dir(root, tied: bool, llama3: bool, family: str | None = None) -> str:
    torch.manual_seed(0)
    if family is None:
        kwargs = dict(TINY, tie_word_embeddings=tied)
        if llama3:
            kwargs["rope_scaling"] = dict(LLAMA3_ROPE)
        hf_config = transformers.LlamaConfig(**kwargs)
    else:
        cls, extra = FAMILIES[family]
        hf_config = cls(**{**TINY, **extra})
    model = transformers.AutoModelForCausalLM.from_config(hf_config)
    with torch.no_grad():  # non-trivial norms (and Qwen2's biases), so a mapping mistake shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    name = family or f"llama-{'tied' if tied else 'untied'}{'-llama3' if llama3 else ''}"
    model.save_pretrained(root / name)
    return str(root / name)


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf_llama")
    return {"untied": _hf_dir(root, False, False), "tied": _hf_dir(root, True, True),
            **{family: _hf_dir(root, False, False, family) for family in FAMILIES}}


def _batch():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (B, SEQ), generator=gen)
    labels = torch.cat([ids[:, 1:], torch.full((B, 1), -100)], dim=1)  # HF shifts inside
    return ids, labels


def _hf_reference(path):
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager").eval()
    ids, _ = _batch()
    out = hf(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {k: p.grad for k, p in hf.named_parameters()}
    reader = HFReader(path)

    def get(key):
        return grads["model." + key] if "model." + key in grads else grads[key]

    return out.logits.detach(), out.loss.detach(), lambda name: llama_canonical(name, get,
                                                                                reader.config)


def _check(path, tp, pp):
    mesh = make_mesh(tp, pp)
    reader = HFReader(path)
    config = reader.config
    spec = stage_spec(config.num_layers, pp, mesh.pp_rank)
    model = Llama(config, mesh, spec.layers, spec.pre_process, spec.post_process)
    assert load_hf_weights(model, reader) == []
    model.eval()
    ref_logits, ref_loss, ref_grad = _hf_reference(path)
    ids, labels = _batch()

    # logits: stage by stage (the last stage's vocab slices gathered over tp)
    hidden = None
    if not mesh.is_first_stage:
        hidden = torch.empty(B, SEQ, config.hidden_size)
        dist.recv(hidden, src=mesh.prev_stage_rank)
    with torch.no_grad():
        out = model(hidden, {"input_ids": ids})
    if not mesh.is_last_stage:
        dist.send(out.contiguous(), dst=mesh.next_stage_rank)
    else:
        logits = gather_full(out, 2, (B, SEQ, VOCAB), mesh.tp_group)
        assert_close(logits, ref_logits, what=f"logits tp={tp} pp={pp}")

    # loss and gradients through the pipeline: 2 micro-batches of 2
    micro = [{"input_ids": ids[i:i + 2], "labels": labels[i:i + 2]} for i in (0, 2)]
    loss = PipelineExecutor(model, mesh, "1f1b", (2, SEQ, config.hidden_size)).run(micro)
    sync_tied_embeddings(model, mesh)
    # replicated k / v heads (tp 4 > 2 kv heads): each rank's share, summed once per step
    sync_sequence_parallel_grads(model, mesh.tp_group)
    assert_close(loss, ref_loss, what=f"loss tp={tp} pp={pp}")
    checked = []
    for name, p in model.named_parameters():
        source = getattr(p, "tied_to", name)
        grad = gather_full(p.grad, p.tp_dim, p.full_shape, mesh.tp_group)
        assert_close(grad, ref_grad(source), what=f"grad of {name} tp={tp} pp={pp}")
        checked.append(source)
    return checked


@pytest.mark.parametrize("which", ["untied", "tied"])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1)])
def test_llama_equals_transformers(hf_dirs, which, tp, pp):
    path = hf_dirs[which]
    results = [_check(path, 1, 1)] if tp * pp == 1 else run_local(_check, tp * pp, path, tp, pp)
    checked = set().union(*map(set, results))
    expected = {n for n in gather_canonical(_full(path))}
    assert checked == expected, checked ^ expected
    assert ("head.weight" in checked) == (which == "untied")


@pytest.mark.parametrize("family, tp, pp", [
    *((family, tp, pp) for family in FAMILIES for tp, pp in ((1, 1), (2, 2))), ("qwen2", 4, 1)])
def test_dense_family_equals_transformers(hf_dirs, family, tp, pp):
    """Qwen3, Qwen2 and Mistral: logits, loss and every gradient equal their transformers
    class's at 1 x 1 and 2 x 2 (Qwen2 at tp 4 too: 2 kv heads, k / v and their biases whole on
    every rank, their gradients summed over tp), Qwen2's and Mistral's sliding windows of 8
    cutting the sequence of 16 (Qwen2's in its second layer only)."""
    path = hf_dirs[family]
    results = [_check(path, 1, 1)] if tp * pp == 1 else run_local(_check, tp * pp, path, tp, pp)
    checked = set().union(*map(set, results))
    assert checked == set(gather_canonical(_full(path)))
    config = HFReader(path).config
    assert type(config) is {"qwen3": Qwen3Config, "qwen2": Qwen2Config,
                            "mistral": MistralConfig}[family]
    assert ("head.weight" in checked) == (family != "qwen3")
    extra = {"qwen3": "layers.1.attn.k_norm.weight", "qwen2": "layers.1.attn.v.bias",
             "mistral": "layers.1.attn.v.weight"}[family]
    assert extra in checked
    windows = [config.layer_window(i) for i in range(config.num_layers)]
    assert windows == {"qwen3": [None, None], "qwen2": [None, SEQ // 2],
                       "mistral": [SEQ // 2] * 2}[family]


def _full(path):
    reader = HFReader(path)
    model = Llama(reader.config, make_mesh(1))
    load_hf_weights(model, reader)
    return model


def test_kv_heads_split_when_tp_divides_them_replicated_otherwise():
    from megapar.mesh import Layout, Mesh

    config = LlamaConfig(**TINY)
    for tp, kv_dim, kv_rows in ((2, 0, 8), (4, None, 16)):  # head size 8, 2 kv heads
        mesh = Mesh.virtual(Layout(tp, 1, 1), 3 if tp == 4 else 1)
        attn = Llama(config, mesh).layers["0"].attn
        assert attn.k.weight.tp_dim == kv_dim and attn.k.weight.shape[0] == kv_rows
        assert attn.local_heads == 4 // tp
    # tp 4, rank 3: query head 3 uses kv head 1 (rows 8..16 of the whole k weight)
    attn = Llama(config, Mesh.virtual(Layout(4, 1, 1), 3)).layers["0"].attn
    assert attn.k.rows == (8, 16) and attn.kv_index == [0]


def test_config_reads_transformers_5_rope_parameters_and_round_trips():
    hf = transformers.LlamaConfig(**TINY, rope_scaling=dict(LLAMA3_ROPE))
    ours = LlamaConfig.from_dict(hf.to_dict())
    assert ours.rope_theta == 500000.0 and ours.rope_scaling["rope_type"] == "llama3"
    assert ours.kv_heads == 2 and ours.head_size == 8
    back = ours.to_hf()
    assert back.num_key_value_heads == 2 and back.architectures == ["LlamaForCausalLM"]
    assert LlamaConfig.from_dict(back.to_dict()) == ours


def _export(path, out, tp):
    mesh = make_mesh(tp)
    reader = HFReader(path)
    model = Llama(reader.config, mesh)
    load_hf_weights(model, reader)
    state = gather_canonical(model)
    if mesh.tp_rank == 0:
        save_hf(state, reader.config, out)
    return True


@pytest.mark.parametrize("which", ["untied", "tied"])
def test_hf_export_at_tp2_reproduces_original_tensors(hf_dirs, which, tmp_path):
    out = tmp_path / "exported"
    run_local(_export, 2, hf_dirs[which], str(out), 2)
    original = transformers.LlamaForCausalLM.from_pretrained(hf_dirs[which])
    exported = transformers.LlamaForCausalLM.from_pretrained(str(out))
    assert exported.config.tie_word_embeddings == (which == "tied")
    a, b = original.state_dict(), exported.state_dict()
    assert a.keys() == b.keys()
    for key, tensor in a.items():
        assert torch.equal(b[key], tensor), key


@pytest.mark.parametrize("name, params", [
    ("llama-1b", 1_235_814_400),    # meta-llama/Llama-3.2-1B (tied head)
    ("llama-8b", 8_030_261_248),    # meta-llama/Llama-3.1-8B
    ("llama-70b", 70_553_706_496),  # meta-llama/Llama-3.1-70B
    ("llama-160m", 162_417_408),    # JackFram/llama-160m
    ("qwen3-0.6b", 596_049_920),    # Qwen/Qwen3-0.6B (tied head)
    ("qwen2.5-0.5b", 494_032_768),  # Qwen/Qwen2.5-0.5B (tied head; q / k / v biases)
    ("mistral-7b", 7_241_732_096),  # mistralai/Mistral-7B-v0.1
])
def test_recipes_have_the_published_parameter_counts(name, params):
    import math

    from megapar.mesh import Layout, Mesh
    from megapar.models.recipes import resolve_model
    from megapar.pipeline.partition import build_stage

    config = resolve_model(name)
    model = build_stage(config, Mesh.virtual(Layout()), 0, init=False)
    assert sum(math.prod(p.full_shape) for p in model.parameters()) == params
    config.validate(Layout(tp=4 if config.num_attention_heads % 4 == 0 else 2, pp=4))


@pytest.mark.parametrize("name, params", [
    ("qwen3-0.6b", 596_049_920), ("qwen2.5-0.5b", 494_032_768), ("mistral-7b", 7_241_732_096)])
def test_dense_recipes_count_as_transformers_builds_them_and_as_the_planner(name, params):
    """The planner's count (`model_params`) and transformers' model of the recipe's config
    (built on the meta device: nothing downloaded) give the published figure."""
    from megapar.models.recipes import resolve_model
    from megapar.plan.params import model_params

    config = resolve_model(name)
    with torch.device("meta"):
        hf = transformers.AutoModelForCausalLM.from_config(config.to_hf())
    assert sum(p.numel() for p in hf.parameters()) == params
    assert model_params(config) == params


@pytest.mark.parametrize("change, layout, message", [
    (dict(num_key_value_heads=3), (1, 1), "num_attention_heads 4 is not a multiple of"),
    (dict(), (3, 1), "4 attention heads are not divisible by --tp 3"),
    (dict(attention_bias=True), (1, 1), "^the config's attention_bias=True: not supported; megapar's Llama"),
    (dict(mlp_bias=True), (1, 1), "^the config's mlp_bias=True: not supported; megapar's Llama has no"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}), (1, 1), "'yarn' is not supported"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 16}), (1, 1),
     "rope_scaling of type 'llama3' needs low_freq_factor \\(a number"),
    (dict(rope_scaling={"type": "linear"}), (1, 1), "type 'linear' needs factor \\(a number"),
    (dict(), (1, 3), "2 layers cannot be cut into --pp 3"),
    # an odd head size named by the fields that make it (it said "head size 15" alone)
    (dict(hidden_size=60), (1, 1), r"^the head size 15 \(hidden_size 60 / num_attention_heads "
                                   r"4\) must be even for rotary embeddings; choose sizes"),
    (dict(head_dim=15), (1, 1), "^head_dim 15 must be even for rotary embeddings"),
])
def test_configs_the_model_cannot_take(change, layout, message):
    from megapar.mesh import Layout

    with pytest.raises(ValueError, match=message):
        LlamaConfig(**{**TINY, **change}).validate(Layout(*layout))


def test_sharded_safetensors_checkpoint_loads(tmp_path, hf_dirs):
    """transformers writes big models as model-0000k-of-0000n.safetensors + an index."""
    model = transformers.LlamaForCausalLM.from_pretrained(hf_dirs["untied"])
    model.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    reader, original = HFReader(tmp_path / "sharded"), _full(hf_dirs["untied"])
    loaded = Llama(reader.config, make_mesh(1))
    assert load_hf_weights(loaded, reader) == []
    a, b = gather_canonical(loaded), gather_canonical(original)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # an index mapping a tensor to a shard that does not hold it was safetensors' traceback
    # ("File does not contain tensor ..."), a new user's finding: one line naming the index
    import json

    from megapar.models.config import ConfigError

    index = tmp_path / "sharded" / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    key = "model.layers.0.self_attn.o_proj.weight"
    wrong = next(f for f in sorted(set(doc["weight_map"].values())) if f != doc["weight_map"][key])
    doc["weight_map"][key] = wrong
    index.write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match=f"maps {key} to {wrong}, which does not hold it: the "
                                          f"index does not match its shards"):
        HFReader(tmp_path / "sharded").check_files()
    # a damaged index or config.json said only json's "Expecting value: line 2 column 1", not
    # which file (read now by load_config_file, megapar's one reader of config files)
    for name in ("model.safetensors.index.json", "config.json"):
        (tmp_path / "sharded" / name).write_text('{"x": \n')
        with pytest.raises(ConfigError, match=f"{name}: not valid JSON at line 2 column 1"):
            HFReader(tmp_path / "sharded")


@pytest.mark.parametrize("model_type, key, value", [
    ("gpt2", "activation_function", "gelu_fast"), ("bert", "hidden_act", "quick_gelu"),
    ("llama", "hidden_act", "relu2"), ("mixtral", "hidden_act", "gelu_fast"),
])
def test_an_activation_megapar_lacks_is_refused_naming_its_field(model_type, key, value):
    """A transformers config.json whose activation megapar does not implement was read and
    failed only when the blocks were built, as "unknown activation 'gelu_fast'", naming no
    field (megapar-convert --from-hf, megapar-train --from-hf, megapar.prepare)."""
    from megapar.models.blocks import ACTIVATIONS
    from megapar.models.config import ACTIVATION_NAMES, ConfigError
    from megapar.models import config_from_dict

    assert set(ACTIVATION_NAMES) == set(ACTIVATIONS)
    with pytest.raises(ConfigError, match=rf"^model config: {key}='{value}' is an activation "
                                          rf"megapar does not implement; it implements gelu, "):
        config_from_dict({"model_type": model_type, key: value})


HUB = {  # config.json as published (the hub's files, transformers 4 spelling), and its size
    "qwen3": ({"architectures": ["Qwen3ForCausalLM"], "attention_bias": False,
               "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
               "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024,
               "initializer_range": 0.02, "intermediate_size": 3072,
               "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
               "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
               "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000,
               "sliding_window": None, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
               "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
               "vocab_size": 151936}, 596_049_920),  # Qwen/Qwen3-0.6B
    "qwen2": ({"architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0,
               "bos_token_id": 151643, "eos_token_id": 151643, "hidden_act": "silu",
               "hidden_size": 896, "initializer_range": 0.02, "intermediate_size": 4864,
               "max_position_embeddings": 32768, "max_window_layers": 24, "model_type": "qwen2",
               "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2,
               "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 32768,
               "tie_word_embeddings": True, "torch_dtype": "bfloat16",
               "transformers_version": "4.40.1", "use_cache": True, "use_mrope": False,
               "use_sliding_window": False, "vocab_size": 151936}, 494_032_768),  # Qwen2.5-0.5B
    "mistral": ({"architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
                 "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
                 "intermediate_size": 14336, "max_position_embeddings": 32768,
                 "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32,
                 "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
                 "sliding_window": 4096, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
                 "transformers_version": "4.34.0.dev0", "use_cache": True, "vocab_size": 32000},
                7_241_732_096),  # mistralai/Mistral-7B-v0.1
}


@pytest.mark.parametrize("family", sorted(HUB))
def test_published_config_json_loads_with_its_size_and_round_trips(family):
    """The hub's config.json of Qwen3-0.6B, Qwen2.5-0.5B and Mistral-7B-v0.1 loads as it is
    (metadata, use_mrope false, Mistral's sliding window of 4096, Qwen's off), gives the
    published parameter count (the planner's), splits over tp 2 x pp 4, and exports a
    transformers config that reads back as the same megapar config (the window too)."""
    from megapar.checkpoint.distributed import differing_fields
    from megapar.mesh import Layout
    from megapar.models import config_from_dict
    from megapar.plan.params import model_params

    raw, params = HUB[family]
    config = config_from_dict(raw)
    assert config.model_type == family and model_params(config) == params
    config.validate(Layout(tp=2, pp=4))
    assert config.max_positions == raw["max_position_embeddings"]
    assert config.attention_window == (4096 if family == "mistral" else None)
    hf = config.to_hf()
    assert hf.architectures == [{"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                 "mistral": "MistralForCausalLM"}[family]]
    back = config_from_dict(hf.to_dict())
    differ = {k for k in set(back.to_dict()) if back.to_dict()[k] != config.to_dict()[k]}
    # transformers keeps a Qwen window only where use_sliding_window; it adds layer_types, and
    # Mistral's head_dim (hidden / heads)
    assert differ <= {"sliding_window", "layer_types", "head_dim"}, differ
    assert back.max_positions == config.max_positions and back.head_size == config.head_size
    assert back.attention_window == config.attention_window
    # a checkpoint of one loads into a model built from the other (head_dim None is
    # hidden / heads, which transformers writes)
    assert differing_fields(back.to_dict(), config.to_dict()) == []


@pytest.mark.parametrize("cls, name", [(Qwen3Config, "Qwen3Config"),
                                       (Qwen2Config, "Qwen2Config"),
                                       (MistralConfig, "MistralConfig")])
def test_dense_config_defaults_are_transformers(cls, name):
    """save_pretrained may leave a field at its default out of config.json: each default of
    megapar's config is its transformers class's."""
    import dataclasses

    theirs = getattr(transformers, name)()
    checked = 0
    for f in dataclasses.fields(cls):
        if f.name in ("head_dim", "layer_types", "rope_scaling") or not hasattr(theirs, f.name):
            continue  # head_dim: transformers fills hidden / heads in; layer_types: per layer;
            # rope_scaling: transformers' rope_parameters (checked below)
        ours = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        want = getattr(theirs, f.name)
        if f.name == "sliding_window" and not getattr(theirs, "use_sliding_window", True):
            want = dataclasses.fields(type(theirs))  # the class's, before __post_init__ drops it
            want = next(g.default for g in want if g.name == "sliding_window")
        assert ours == want, (f.name, ours, want)
        checked += 1
    assert cls().rope_theta == theirs.rope_parameters["rope_theta"]
    assert theirs.rope_parameters["rope_type"] == "default" and cls().rope_scaling is None
    whole = theirs.hidden_size // theirs.num_attention_heads
    assert cls().head_size == getattr(theirs, "head_dim", whole)
    assert checked >= 15, checked


@pytest.mark.parametrize("family, change, message", [
    ("qwen3", dict(attention_bias=True), "^the config's attention_bias=True: not supported; megapar's qwen3 "
                                         "has no biases \\(as every published qwen3\\): use a "
                                         "model without them \\(attention_bias false\\)$"),
    ("qwen2", dict(mlp_bias=True), "^the config's mlp_bias=True: not supported; megapar's qwen2 has only "
                                   "q / k / v biases"),
    ("qwen2", dict(layer_types=["full_attention"]),
     "^layer_types \\['full_attention'\\] must name each of the 2 layers full_attention or "
     "sliding_attention; fix it or remove it$"),
    ("mistral", dict(sliding_window=0),
     "^model config: sliding_window=0 must be a whole number >= 1$"),
    ("qwen3", dict(use_mrope=True), "^model config: unknown key 'use_mrope' for qwen3"),
    ("qwen2", dict(use_mrope=True), "^model config: use_mrope=True is a transformers Qwen2Config "
                                    "setting megapar does not implement"),
])
def test_dense_configs_the_model_cannot_take(family, change, message):
    from megapar.mesh import Layout
    from megapar.models import config_from_dict
    from megapar.models.config import ConfigError

    with pytest.raises(ConfigError, match=message):
        config_from_dict({"model_type": family, **TINY, **change}).validate(Layout())
