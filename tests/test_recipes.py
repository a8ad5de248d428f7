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


@pytest.mark.parametrize("layout, message", [
    (Layout(tp=5), "12 attention heads are not divisible by --tp 5"),
    (Layout(pp=16), "12 layers cannot be cut into --pp 16 stages"),
])
def test_layout_the_model_cannot_take(layout, message):
    with pytest.raises(LayoutError, match=message):
        resolve_model("gpt2-124m").validate(layout)
