"""GPT-2, BERT and Llama (its dense variants Qwen3, Qwen2, Mistral; its MoE variants Mixtral,
Qwen3-MoE, and DeepSeek-V3 with Multi-head Latent Attention) from tensor-parallel layers.

Models never import the pipeline or CLI."""

from megapar.models.bert import Bert
from megapar.models.blocks import set_cp_comm, set_recompute, set_sp_regather
from megapar.models.config import (
    CONFIG_CLASSES,
    HF_SUPPORTED_DEFAULTS,
    LLAMA_TYPES,
    BertConfig,
    ConfigError,
    GPT2Config,
    LlamaConfig,
    config_from_dict,
    config_from_file,
    config_from_hf,
    load_config_file,
)
from megapar.models.deepseek import DeepseekV3
from megapar.models.dense_config import (
    DENSE_SUPPORTED_DEFAULTS,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)
from megapar.models.gpt2 import GPT2
from megapar.models.llama import Llama
from megapar.models.moe_config import (
    MOE_SUPPORTED_DEFAULTS,
    DeepseekV3Config,
    MixtralConfig,
    Qwen3MoeConfig,
)
from megapar.models.stage import set_loss_chunk_tokens, set_loss_fn, set_loss_terms

MODEL_CLASSES = {
    "gpt2": GPT2,
    "bert": Bert,
    **dict.fromkeys(LLAMA_TYPES, Llama),
    "deepseek_v3": DeepseekV3,
}
# the dense and MoE variants subclass LlamaConfig (config.py cannot import them: a cycle)
CONFIG_CLASSES.update(
    {
        "mixtral": MixtralConfig,
        "qwen3_moe": Qwen3MoeConfig,
        "deepseek_v3": DeepseekV3Config,
        "qwen3": Qwen3Config,
        "qwen2": Qwen2Config,
        "mistral": MistralConfig,
    }
)
HF_SUPPORTED_DEFAULTS.update(MOE_SUPPORTED_DEFAULTS)
HF_SUPPORTED_DEFAULTS.update(DENSE_SUPPORTED_DEFAULTS)


def build_model(config, mesh, layers=None, pre_process=True, post_process=True, tracker=None):
    """The model (or pipeline stage) for a config; weights are left uninitialised."""
    return MODEL_CLASSES[config.model_type](
        config, mesh, layers, pre_process, post_process, tracker
    )


__all__ = [
    "GPT2",
    "Bert",
    "GPT2Config",
    "BertConfig",
    "ConfigError",
    "config_from_dict",
    "config_from_hf",
    "config_from_file",
    "load_config_file",
    "build_model",
    "set_recompute",
    "set_sp_regather",
    "set_cp_comm",
    "MODEL_CLASSES",
    "Llama",
    "LlamaConfig",
    "MixtralConfig",
    "Qwen3MoeConfig",
    "DeepseekV3",
    "DeepseekV3Config",
    "Qwen3Config",
    "Qwen2Config",
    "MistralConfig",
    "set_loss_chunk_tokens",
    "set_loss_terms",
    "set_loss_fn",
]
