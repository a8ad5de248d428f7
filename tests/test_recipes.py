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


@pytest.mark.parametrize("layout, message", [
    (Layout(tp=5), "12 attention heads are not divisible by --tp 5"),
    (Layout(pp=16), "12 layers cannot be cut into --pp 16 stages"),
])
def test_layout_the_model_cannot_take(layout, message):
    with pytest.raises(LayoutError, match=message):
        resolve_model("gpt2-124m").validate(layout)


def test_train_help_names_every_model_family_and_parallelism():
    """megapar-train --help began "Train a GPT-2, BERT or Llama with tensor, pipeline and data
    parallelism" while it trains Mixtral and Qwen3-MoE too, with --cp and --ep."""
    from megapar.models.config import CONFIG_CLASSES
    from megapar.training.config import build_parser

    names = {"gpt2": "GPT-2", "bert": "BERT", "llama": "Llama", "mixtral": "Mixtral",
             "qwen3_moe": "Qwen3-MoE"}
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
