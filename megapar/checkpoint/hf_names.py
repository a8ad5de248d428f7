"""transformers' parameter names and layouts per model kind (GPT-2, BERT, the Llama layout):
each megapar canonical tensor from the HF tensors it is made of, the HF state dict from
canonical tensors, and the HF names of one megapar parameter.

GPT-2's Conv1D stores weights transposed and fuses q, k, v into `c_attn` as [q | k | v]; BERT
keeps query, key and value apart; megapar's fused `attn.qkv` is head-major
(`partition.fuse_heads`). Llama has transformers' layout: only the names differ (so have
Qwen3's q / k norms, Qwen2's q / k / v biases, Mistral, Mixtral's, Qwen3-MoE's and
DeepSeek-V3's layers (its MLA projections, its router's e_score_correction_bias: the router's
`bias` buffer) but their stacked experts).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from megapar.models.config import LLAMA_TYPES
from megapar.tensor_parallel.partition import fuse_heads, unfuse_heads

Getter = Callable[[str], torch.Tensor]
"""Reads an HF tensor by its name without the base model's prefix (`HFReader.get`)."""
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")


# --- GPT-2 ---------------------------------------------------------------------------------
_GPT2_TOP = {
    "embed.word.weight": "wte.weight",
    "embed.position.weight": "wpe.weight",
    "final_norm.weight": "ln_f.weight",
    "final_norm.bias": "ln_f.bias",
}
_GPT2_LAYER = {
    "ln_1": "ln_1",
    "ln_2": "ln_2",
    "attn.proj": "attn.c_proj",
    "mlp.fc": "mlp.c_fc",
    "mlp.proj": "mlp.c_proj",
}


def gpt2_canonical(name: str, get: Getter, config) -> torch.Tensor:
    """Canonical tensor `name` of a GPT-2 model from its HF tensors (`get`)."""
    if name in _GPT2_TOP:
        return get(_GPT2_TOP[name])
    m = _LAYER.fullmatch(name)
    assert m is not None  # every other name is a layer's
    i, rest = m.groups()
    module, kind = rest.rsplit(".", 1)
    if module == "attn.qkv":
        fused = get(f"h.{i}.attn.c_attn.{kind}")
        return fuse_heads((fused.T if kind == "weight" else fused).chunk(3), config.n_head)
    tensor = get(f"h.{i}.{_GPT2_LAYER[module]}.{kind}")
    conv1d = module != "ln_1" and module != "ln_2"
    return tensor.T if conv1d and kind == "weight" else tensor


def gpt2_to_hf(canonical: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """GPT2LMHeadModel's tensors (full names) from canonical tensors."""
    out = {"transformer." + hf: canonical[ours] for ours, hf in _GPT2_TOP.items()}
    for i in range(config.n_layer):
        p, hp = f"layers.{i}.", f"transformer.h.{i}."
        for kind in ("weight", "bias"):
            qkv = torch.cat(unfuse_heads(canonical[p + f"attn.qkv.{kind}"], config.n_head))
            out[hp + f"attn.c_attn.{kind}"] = qkv.T if kind == "weight" else qkv
        for ours, hf in _GPT2_LAYER.items():
            conv1d = ours not in ("ln_1", "ln_2")
            w = canonical[p + ours + ".weight"]
            out[hp + hf + ".weight"] = w.T if conv1d else w
            out[hp + hf + ".bias"] = canonical[p + ours + ".bias"]
    return out


# --- BERT ----------------------------------------------------------------------------------
_BERT_TOP = {
    "embed.word": "embeddings.word_embeddings",
    "embed.position": "embeddings.position_embeddings",
    "embed.token_type": "embeddings.token_type_embeddings",
    "embed.norm": "embeddings.LayerNorm",
}
_BERT_QKV = ("attention.self.query", "attention.self.key", "attention.self.value")
_BERT_LAYER = {
    "attn.proj": "attention.output.dense",
    "attn_norm": "attention.output.LayerNorm",
    "mlp.fc": "intermediate.dense",
    "mlp.proj": "output.dense",
    "mlp_norm": "output.LayerNorm",
}
_BERT_HEAD = {
    "head.transform": "cls.predictions.transform.dense",
    "head.norm": "cls.predictions.transform.LayerNorm",
}


def bert_canonical(name: str, get: Getter, config) -> torch.Tensor:
    """Canonical tensor `name` of a BERT model from its HF tensors (`get`)."""
    if name == "head.bias":
        return get("cls.predictions.bias")
    module, kind = name.rsplit(".", 1)
    if module in _BERT_TOP:
        return get(f"{_BERT_TOP[module]}.{kind}")
    if module in _BERT_HEAD:
        return get(f"{_BERT_HEAD[module]}.{kind}")
    m = _LAYER.fullmatch(module + "." + kind)
    assert m is not None  # every other name is a layer's
    i, rest = m.groups()
    sub, kind = rest.rsplit(".", 1)
    if sub == "attn.qkv":
        return fuse_heads(
            [get(f"encoder.layer.{i}.{hf}.{kind}") for hf in _BERT_QKV], config.num_attention_heads
        )
    return get(f"encoder.layer.{i}.{_BERT_LAYER[sub]}.{kind}")


def bert_to_hf(canonical: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """BertForMaskedLM's tensors (full names) from canonical tensors."""
    out = {}
    for ours, hf in _BERT_TOP.items():
        for kind in ("weight", "bias") if ours == "embed.norm" else ("weight",):
            out[f"bert.{hf}.{kind}"] = canonical[f"{ours}.{kind}"]
    for i in range(config.num_hidden_layers):
        for ours, hf in _BERT_LAYER.items():
            for kind in ("weight", "bias"):
                out[f"bert.encoder.layer.{i}.{hf}.{kind}"] = canonical[f"layers.{i}.{ours}.{kind}"]
        for kind in ("weight", "bias"):
            parts = unfuse_heads(
                canonical[f"layers.{i}.attn.qkv.{kind}"], config.num_attention_heads
            )
            for hf, t in zip(_BERT_QKV, parts):
                out[f"bert.encoder.layer.{i}.{hf}.{kind}"] = t
    for ours, hf in _BERT_HEAD.items():
        for kind in ("weight", "bias"):
            out[f"{hf}.{kind}"] = canonical[f"{ours}.{kind}"]
    out["cls.predictions.bias"] = canonical["head.bias"]
    return out


# --- Llama ---------------------------------------------------------------------------------
_LLAMA_TOP = {"embed.word.weight": "embed_tokens.weight", "final_norm.weight": "norm.weight"}
_LLAMA_LAYER = {
    "attn_norm": "input_layernorm",
    "mlp_norm": "post_attention_layernorm",
    "attn.q": "self_attn.q_proj",
    "attn.k": "self_attn.k_proj",
    "attn.v": "self_attn.v_proj",
    "attn.proj": "self_attn.o_proj",
    "mlp.gate": "mlp.gate_proj",
    "mlp.up": "mlp.up_proj",
    "mlp.down": "mlp.down_proj",
    "attn.q_a": "self_attn.q_a_proj",
    "attn.q_a_norm": "self_attn.q_a_layernorm",
    "attn.q_b": "self_attn.q_b_proj",
    "attn.kv_a": "self_attn.kv_a_proj_with_mqa",
    "attn.kv_a_norm": "self_attn.kv_a_layernorm",
    "attn.kv_b": "self_attn.kv_b_proj",
}


_MOE_LAYER = {
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
    "mlp.shared.gate.weight": "mlp.shared_experts.gate_proj.weight",
    "mlp.shared.up.weight": "mlp.shared_experts.up_proj.weight",
    "mlp.shared.down.weight": "mlp.shared_experts.down_proj.weight",
}
"""Qwen3's q / k norms and the shared experts (DeepSeek's names; no transformers class of
Mixtral or Qwen3-MoE has them)."""
_EXPERTS = {  # model type -> the MoE block's name, (gate, up, down) of expert e
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "deepseek_v3": ("mlp", ("gate_proj", "up_proj", "down_proj")),
}
"""The routed experts as files hold them (transformers 4 and 5 alike: 5 fuses them into
`experts.gate_up_proj` [E, 2I, H] / `experts.down_proj` [E, H, I] in memory only, which is
megapar's layout; a file with the fused names is read too)."""
_FUSED_BLOCK = "mlp"
"""The MoE block's name in a transformers 5 model in memory (Mixtral's too: its
`block_sparse_moe` is a file name only), where the router is `mlp.gate` and the experts fused."""


def _llama_layer_hf(i: str, rest: str, config) -> list[str]:
    """The HF names (no model prefix) of layer i's canonical tensor `rest`."""
    if rest in _MOE_LAYER:
        return [f"layers.{i}.{_MOE_LAYER[rest]}"]
    if rest.startswith(("mlp.router.", "mlp.experts.")):
        block, (gate, up, down) = _EXPERTS[config.model_type]
        if rest == "mlp.router.weight":
            return [f"layers.{i}.{block}.gate.weight"]
        if rest == "mlp.router.bias":  # DeepSeek-V3's buffer
            return [f"layers.{i}.{block}.gate.e_score_correction_bias"]
        names = (gate, up) if rest == "mlp.experts.gate_up" else (down,)
        return [
            f"layers.{i}.{block}.experts.{e}.{n}.weight"
            for e in range(config.num_local_experts)
            for n in names
        ]
    module, kind = rest.rsplit(".", 1)
    return [f"layers.{i}.{_LLAMA_LAYER[module]}.{kind}"]


def _experts_canonical(i: str, rest: str, get: Getter, config) -> torch.Tensor:
    """Layer i's stacked expert weight `rest` from the per-expert (or fused) HF tensors."""
    kind = "gate_up_proj" if rest.endswith("gate_up") else "down_proj"
    for block in dict.fromkeys((_EXPERTS[config.model_type][0], _FUSED_BLOCK)):
        try:
            return get(f"layers.{i}.{block}.experts.{kind}")
        except KeyError:
            pass
    parts = [get(n) for n in _llama_layer_hf(i, rest, config)]
    if rest.endswith("gate_up"):  # (gate, up) per expert
        return torch.stack([torch.cat(parts[j : j + 2]) for j in range(0, len(parts), 2)])
    return torch.stack(parts)


def llama_canonical(name: str, get: Getter, config) -> torch.Tensor:
    """Canonical tensor `name` of a Llama (Mixtral, Qwen3-MoE) model from its HF tensors
    (`get`). Same layout as transformers (nn.Linear weights, no fusing) except the routed
    experts, stacked per layer."""
    if name == "head.weight":  # untied head; a tied model has no lm_head to read
        return get("lm_head.weight")
    if name in _LLAMA_TOP:
        return get(_LLAMA_TOP[name])
    m = _LAYER.fullmatch(name)
    assert m is not None  # every other name is a layer's
    i, rest = m.groups()
    if rest.startswith("mlp.experts."):
        return _experts_canonical(i, rest, get, config)
    hf = _llama_layer_hf(i, rest, config)[0]
    if rest == "mlp.router.weight":  # a file's name, or a transformers 5 model's in memory
        try:
            return get(hf)
        except KeyError:
            return get(f"layers.{i}.{_FUSED_BLOCK}.gate.weight")
    return get(hf)


def llama_to_hf(canonical: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """LlamaForCausalLM's (MixtralForCausalLM's, Qwen3MoeForCausalLM's) tensors (full names)
    from canonical tensors; routed experts one tensor per expert and projection, as
    save_pretrained writes them."""
    out = {"model." + hf: canonical[ours] for ours, hf in _LLAMA_TOP.items()}
    for name, tensor in canonical.items():
        m = _LAYER.fullmatch(name)
        if m is None:
            continue
        i, rest = m.groups()
        hf = ["model." + n for n in _llama_layer_hf(i, rest, config)]
        if rest == "mlp.experts.gate_up":
            size = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                out[hf[2 * e]], out[hf[2 * e + 1]] = tensor[e, :size], tensor[e, size:]
        elif rest == "mlp.experts.down":
            out.update({hf[e]: tensor[e] for e in range(tensor.shape[0])})
        else:
            out[hf[0]] = tensor
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = canonical["head.weight"]
    return out


CANONICAL = {
    "gpt2": gpt2_canonical,
    "bert": bert_canonical,
    **dict.fromkeys(LLAMA_TYPES, llama_canonical),
}
"""The canonical-tensor reader per model type."""
TO_HF = {
    "gpt2": gpt2_to_hf,
    "bert": bert_to_hf,
    **dict.fromkeys(LLAMA_TYPES, llama_to_hf),
}
"""The canonical -> HF state mapping per model type (uncontiguous views; `hf.to_hf_state`)."""
ARCHITECTURES = {
    "gpt2": "GPT2LMHeadModel",
    "bert": "BertForMaskedLM",
    "llama": "LlamaForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
}
"""The transformers class megapar trains and exports, per model type."""
DEEPSEEK_ROUTER_TYPES = ("deepseek_v3",)
"""Model types whose transformers class has DeepSeek's router (sigmoid scores, shared experts,
the e_score_correction_bias buffer: megapar's router `bias`, imported and exported with the
weights)."""
HF_PREFIXES = ("transformer.", "bert.", "model.")
"""The base models' name prefixes in the full HF names."""


TIED_HEAD = {
    "gpt2": "lm_head",
    **dict.fromkeys(LLAMA_TYPES, "lm_head"),
    "bert": "cls.predictions.decoder",
}
"""The transformers module that uses a tied copy of the word embedding (the last stage's)."""


def hf_parameter_names(config, name: str, tied: bool = False) -> list[str]:
    """The transformers names (with the base model's prefix) of megapar parameter `name`
    (canonical): one, or several where megapar fuses them (BERT's query, key and value).
    `tied`: the parameter is a stage's tied copy of the word embedding (`tied_to`)."""
    kind = config.model_type
    if tied:
        return [f"{TIED_HEAD[kind]}.weight"]
    layer = _LAYER.fullmatch(name)
    if kind == "gpt2":
        if name in _GPT2_TOP:
            return ["transformer." + _GPT2_TOP[name]]
        assert layer is not None  # every other name is a layer's
        i, rest = layer.groups()
        module, end = rest.rsplit(".", 1)
        hf = "attn.c_attn" if module == "attn.qkv" else _GPT2_LAYER[module]
        return [f"transformer.h.{i}.{hf}.{end}"]
    if kind == "bert":
        if name == "head.bias":
            return ["cls.predictions.bias"]
        module, end = name.rsplit(".", 1)
        if module in _BERT_TOP:
            return [f"bert.{_BERT_TOP[module]}.{end}"]
        if module in _BERT_HEAD:
            return [f"{_BERT_HEAD[module]}.{end}"]
        assert layer is not None  # every other name is a layer's
        i, rest = layer.groups()
        sub, end = rest.rsplit(".", 1)
        parts = _BERT_QKV if sub == "attn.qkv" else (_BERT_LAYER[sub],)
        return [f"bert.encoder.layer.{i}.{hf}.{end}" for hf in parts]
    if name == "head.weight":
        return ["lm_head.weight"]
    if name in _LLAMA_TOP:
        return ["model." + _LLAMA_TOP[name]]
    assert layer is not None  # every other name is a layer's
    i, rest = layer.groups()
    return ["model." + n for n in _llama_layer_hf(i, rest, config)]
