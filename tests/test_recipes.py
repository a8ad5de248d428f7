import re

import pytest

from megapar.mesh import Layout, LayoutError
from megapar.models import BertConfig, ConfigError, GPT2Config
from megapar.models.recipes import list_recipes, resolve_model


def test_named_recipes_load_with_hf_field_names():
    assert {"gpt2-124m", "gpt2-350m", "bert-base", "bert-large", "gpt2-tiny",
            "bert-tiny"} <= set(list_recipes())
    gpt = resolve_model("gpt2-124m")
    assert isinstance(gpt, GPT2Config) and (gpt.n_layer, gpt.n_embd, gpt.n_head) == (12, 768, 12)
    assert gpt.to_hf().n_embd == 768
    bert = resolve_model("bert-large")
    assert isinstance(bert, BertConfig) and bert.num_hidden_layers == 24


def test_unknown_model_names_the_recipes():
    with pytest.raises(ConfigError, match="unknown model 'gpt5'; known recipes: .*gpt2-124m"):
        resolve_model("gpt5")
    # a misspelt recipe is named, as a misspelt flag is (a getting-started tryout)
    with pytest.raises(ConfigError) as exc:
        resolve_model("gpt2-tinny")
    assert str(exc.value) == "unknown model 'gpt2-tinny'; did you mean gpt2-tiny?"
    # Hugging Face's names of a recipe's model (a new user's --model gpt2 got the whole list)
    for hub, recipe in (("gpt2", "gpt2-124m"), ("openai-community/gpt2-xl", "gpt2-1.5b"),
                        ("bert-base-uncased", "bert-base")):
        with pytest.raises(ConfigError) as exc:
            resolve_model(hub)
        assert str(exc.value) == (f"model {hub!r} is a Hugging Face Hub id, and megapar "
                                  f"downloads nothing: its shape is the recipe --model {recipe} "
                                  f"(its weights: --from-hf DIR of a saved copy)")
        hub_shape = resolve_model(recipe)
        assert hub_shape.vocab_size == (30522 if "bert" in hub else 50257)
    # the hub ids of the Llama, Qwen, Mistral and DeepSeek recipes (meta-llama/Llama-3.2-1B
    # was "no such file or directory", a re-test), an -Instruct of the same shapes, a
    # trailing slash; each recipe has the published shapes (vocabulary, hidden, layers)
    for hub, recipe, shape in (
            ("meta-llama/Llama-3.2-1B", "llama-1b", (128256, 2048, 16)),
            ("meta-llama/Llama-3.2-1B-Instruct", "llama-1b", (128256, 2048, 16)),
            ("meta-llama/Meta-Llama-3.1-8B", "llama-8b", (128256, 4096, 32)),
            ("meta-llama/Llama-3.1-70B", "llama-70b", (128256, 8192, 80)),
            ("Qwen/Qwen3-0.6B", "qwen3-0.6b", (151936, 1024, 28)),
            ("Qwen/Qwen2.5-0.5B-Instruct", "qwen2.5-0.5b", (151936, 896, 24)),
            ("mistralai/Mistral-7B-v0.1", "mistral-7b", (32000, 4096, 32)),
            ("mistralai/Mixtral-8x7B-v0.1", "mixtral-8x7b", (32000, 4096, 32)),
            ("Qwen/Qwen3-30B-A3B", "qwen3-30b-a3b", (151936, 2048, 48)),
            ("deepseek-ai/DeepSeek-V3", "deepseek-v3", (129280, 7168, 61)),
            ("mistralai/Mistral-7B-Instruct-v0.1", "mistral-7b", (32000, 4096, 32)),
            ("Qwen/Qwen3-0.6B-Base", "qwen3-0.6b", (151936, 1024, 28)),
            ("gpt2/", "gpt2-124m", (50257, 768, 12))):
        with pytest.raises(ConfigError) as exc:
            resolve_model(hub)
        assert f"{hub!r} is a Hugging Face Hub id, and megapar downloads nothing: its shape is " \
               f"the recipe --model {recipe} (" in str(exc.value)
        config = resolve_model(recipe).to_hf() if recipe == "gpt2-124m" else resolve_model(recipe)
        assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == shape
    # another hub id: megapar downloads nothing, said with what to do (it read "no such file or
    # directory" alone)
    with pytest.raises(ConfigError) as exc:
        resolve_model("mistralai/Mistral-7B-Instruct-v0.3")
    assert str(exc.value).startswith(
        "model 'mistralai/Mistral-7B-Instruct-v0.3': no such file or directory, and megapar "
        "downloads nothing (a Hugging Face Hub id is read from a saved copy: save_pretrained(DIR), "
        "then --from-hf DIR for its weights, or --model DIR for its config); or pass a recipe "
        "name: "), str(exc.value)


def test_a_missing_config_file_names_what_to_pass_instead(tmp_path):
    """`--model mymodel.json` (no such file) said "not found" and nothing more, where a
    misspelt recipe name gets "did you mean": the close recipes or all of them, and a config
    without model_type says the key is missing (it said "unknown model_type None")."""
    with pytest.raises(ConfigError) as exc:
        resolve_model("gpt2-124.json")
    assert str(exc.value) == ("model config file gpt2-124.json not found; pass an existing "
                              "JSON/YAML config file or a recipe name: did you mean gpt2-124m, "
                              "gpt2-774m or gpt2-1.5b?")
    with pytest.raises(ConfigError, match=r"not found; pass an existing JSON/YAML config file or "
                       r"a recipe name: bert-base, .*gpt2-124m, .*llama-tiny"):
        resolve_model("mymodel.json")
    with pytest.raises(ConfigError, match=r"^model config file \./mymodel\.json not found"):
        resolve_model("./mymodel.json")  # as typed (Path dropped the ./)
    for no_kind in ('{"hidden_size": 64}', '{"model_type": ""}'):
        (tmp_path / "c.json").write_text(no_kind)
        with pytest.raises(ConfigError, match=r'the config has no model_type; add "model_type": '
                           r"one of bert, deepseek_v3, gpt2, llama, .*, qwen3 or qwen3_moe$"):
            resolve_model(str(tmp_path / "c.json"))
    (tmp_path / "c.json").write_text('{"model_type": "gptneox"}')
    with pytest.raises(ConfigError, match=r"/c.json: unknown model_type 'gptneox'; expected one "
                       r"of bert, .* or qwen3_moe$"):
        resolve_model(str(tmp_path / "c.json"))


def test_a_config_path_with_a_tilde_is_read(tmp_path, monkeypatch):
    """`megapar-plan --model=~/x.json` (no shell expands ~ after =) and `prepare("~/x.json")`
    said the file was not found, where megapar-train read it (a re-test)."""
    import shutil
    from pathlib import Path

    shutil.copy(Path(__file__).resolve().parents[1] / "models" / "gpt2-tiny.json",
                tmp_path / "x.json")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert resolve_model("~/x.json") == resolve_model("gpt2-tiny")


@pytest.mark.parametrize("name", ["/no/such/dir/", "./mymodel", "models/gpt2"])
def test_a_path_that_does_not_exist_is_named_missing_not_an_unknown_recipe(tmp_path, name):
    """`prepare("/x/nothere/")` (a directory of a transformers model, mistyped) said "unknown
    model ...; known recipes: ..." (a python-api tryout): a name with a path's characters is
    a path, and no recipe has them."""
    import megapar

    with pytest.raises(ConfigError) as exc:
        resolve_model(name)
    assert str(exc.value) == (f"model {name!r}: no such file or directory; pass a recipe name, "
                              f"a JSON/YAML config file, or a directory that holds config.json")
    with pytest.raises(ConfigError, match=f"^megapar.prepare: model {re.escape(repr(name))}: "
                       f"no such file or directory"):
        megapar.prepare(name)


@pytest.mark.parametrize("layout, message", [
    (Layout(tp=5), "12 attention heads are not divisible by --tp 5"),
    (Layout(pp=16), "12 layers cannot be cut into --pp 16 stages"),
])
def test_layout_the_model_cannot_take(layout, message):
    with pytest.raises(LayoutError, match=message):
        resolve_model("gpt2-124m").validate(layout)


@pytest.mark.parametrize("model, layout, line", [
    ("gpt2-124m", Layout(tp=5), "12 attention heads are not divisible by --tp 5; use --tp 1, 2, 3, "
     "4, 6 or 12 (each divides the 12 attention heads, hidden size 768, FFN size 3072)"),
    ("bert-tiny", Layout(tp=8), "4 attention heads are not divisible by --tp 8; use --tp 1, 2 or 4 "
     "(each divides the 4 attention heads, hidden size 64, FFN size 128)"),
    ("llama-tiny", Layout(tp=3), "4 attention heads are not divisible by --tp 3; use --tp 1, 2 or "
     "4 (each divides the 4 attention heads, FFN size 176)"),
    ("llama-tiny", Layout(tp=4), None),  # 2 kv heads, replicated over 4 ranks: fine
])
def test_a_tp_the_model_cannot_take_names_the_ones_it_can(model, layout, line):
    # "4 attention heads are not divisible by --tp 3" named no --tp that works
    if line is None:
        resolve_model(model).validate(layout)
        return
    with pytest.raises(LayoutError) as e:
        resolve_model(model).validate(layout)
    assert str(e.value) == line


def test_an_ffn_size_tp_does_not_split_names_the_ones_it_does():
    config = resolve_model("llama-tiny")
    config.intermediate_size = 174
    with pytest.raises(LayoutError) as e:
        config.validate(Layout(tp=4))
    assert str(e.value) == ("FFN size 174 is not divisible by --tp 4; use --tp 1 or 2 (each "
                            "divides the 4 attention heads, FFN size 174)")


@pytest.mark.parametrize("model", ["gpt2-tiny", "bert-tiny", "llama-tiny", "mixtral-tiny",
                                   "qwen3-moe-tiny"])
def test_a_layout_refusal_is_worded_for_its_caller_at_the_source(model):
    """validate(layout) words the refusal for megapar-train (--tp 3, --pp 99), validate(layout,
    api=True) for megapar.prepare (tp=3, pp=99): the same sentence, no flag left in it (prepare
    rewrote megapar-train's with a regular expression)."""
    config = resolve_model(model)
    for layout, cli, api in ((Layout(tp=3), "--tp 3; use --tp 1", "tp=3; use tp=1"),
                             (Layout(pp=99), "into --pp 99 stages", "into pp=99 stages")):
        with pytest.raises(LayoutError) as flags:
            config.validate(layout)
        with pytest.raises(LayoutError) as words:
            config.validate(layout, api=True)
        assert cli in str(flags.value) and api in str(words.value) and "--" not in str(words.value)
        said = str(flags.value).replace("lower --pp", "lower pp").replace("--tp ", "tp=")
        assert str(words.value) == said.replace("--pp ", "pp=")


def test_train_help_names_every_model_family_and_parallelism():
    """megapar-train --help began "Train a GPT-2, BERT or Llama with tensor, pipeline and data
    parallelism" while it trains Mixtral and Qwen3-MoE too, with --cp and --ep."""
    from megapar.models.config import CONFIG_CLASSES
    from megapar.training.config import build_parser

    names = {"gpt2": "GPT-2", "bert": "BERT", "llama": "Llama", "mixtral": "Mixtral",
             "qwen3_moe": "Qwen3-MoE", "qwen3": "Qwen3,", "qwen2": "Qwen2", "mistral": "Mistral",
             "deepseek_v3": "DeepSeek-V3"}
    text = build_parser().description
    assert set(CONFIG_CLASSES) <= set(names), sorted(CONFIG_CLASSES)
    for model_type in CONFIG_CLASSES:
        assert names[model_type] in text, (model_type, text)
    for kind in ("tensor", "context", "pipeline", "data", "expert"):
        assert kind in text, (kind, text)


@pytest.mark.parametrize("field, value, fix", [
    ("num_experts_per_tok", 9, "route each token to at most 8"),
    ("moe_router_score", "relu", "use 'softmax' (Mixtral, Qwen3-MoE) or 'sigmoid'"),
    ("use_sliding_window", True, "set use_sliding_window false"),
])
def test_moe_config_refusals_say_the_fix(field, value, fix):
    """Each MoE config refusal names the problem and the fix; these three named only the
    problem ('num_experts_per_tok 9 exceeds the 8 experts')."""
    config = resolve_model("qwen3-moe-tiny")
    setattr(config, field, value)
    with pytest.raises(ConfigError, match=f"{field}.*; {re.escape(fix)}"):
        config.validate(Layout())


def test_an_address_given_as_a_model_is_said_as_one():
    """--model hf://gpt2 (or prepare('hf://gpt2')) read "no such file or directory" with the
    recipe list; --from-hf named it an address already (a re-test)."""
    for api, weights in ((False, "--from-hf DIR"), (True, "prepare(DIR)")):
        with pytest.raises(ConfigError) as exc:
            resolve_model("hf://gpt2", api=api)
        assert str(exc.value) == ("model 'hf://gpt2' is an address, and megapar downloads "
                                  "nothing: save the model with save_pretrained(DIR) where it "
                                  f"can be reached, then pass {weights}")
