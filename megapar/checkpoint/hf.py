"""Hugging Face transformers checkpoints in and out (GPT2LMHeadModel, BertForMaskedLM, BertModel,
LlamaForCausalLM).

megapar's *canonical* state is the full (unsharded, unpadded) tensor of every parameter under its
megapar name (`layers.3.attn.qkv.weight`, ...), the same in every layout. This module maps between
canonical tensors and transformers' names and layouts (GPT-2's Conv1D stores weights
transposed and fuses q, k, v into `c_attn` as [q | k | v]; megapar's fused `attn.qkv` is
head-major, `partition.fuse_heads`, so each tp rank holds whole heads). Reading is lazy: a rank materialises only the
tensors it asks for, one at a time, and keeps its shard.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import save_file

from megapar.checkpoint.format import CheckpointError, open_safetensors
from megapar.data.hf_tokenizer import save_for_transformers
from megapar.models.config import ConfigError, config_from_dict, config_from_hf
from megapar.tensor_parallel.partition import (
    fuse_heads,
    gather_full,
    shard_of,
    unfuse_heads,
)

Getter = Callable[[str], torch.Tensor]
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")


def _open(path: Path):
    """A safetensors file of a transformers directory; ConfigError when it is not one."""

    try:
        return open_safetensors(path, "weights file")
    except CheckpointError as exc:
        raise ConfigError(str(exc).replace("use another checkpoint", "save the model again "
                                           "with save_pretrained")) from None


def _load_pickled_weights(path: Path) -> dict:
    """An old-style ``pytorch_model.bin``, read by torch with ``weights_only`` (tensors only:
    a pickle that would run code or build other objects is refused, in one line)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - UnpicklingError, EOFError, RuntimeError ...
        lines = [x.strip() for x in str(exc).splitlines() if x.strip()] or [""]
        first = next((x for x in lines if "GLOBAL" in x or "WeightsUnpickler" in x),
                     lines[-1] if len(lines) > 1 else lines[0])[:160]
        raise ConfigError(f"{path}: refused: not a plain pickle of weights ({type(exc).__name__}"
                          f": {first}); megapar reads tensors only, never code; convert it with "
                          f"transformers (from_pretrained, then save_pretrained, which writes "
                          f"model.safetensors) on a machine you trust") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor)
                                              for v in state.values()):
        raise ConfigError(f"{path}: not a state dict of tensors; save the model with "
                          f"save_pretrained")
    return state


class HFReader:
    """Lazy access to the tensors of a local transformers directory (no network)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        cfg = self.path / "config.json"
        if not cfg.exists():
            raise FileNotFoundError(f"{self.path}: no config.json; expected a transformers "
                                    f"directory written by save_pretrained")
        raw = json.loads(cfg.read_text())
        self.config = config_from_dict(raw)
        self._saved_dtype = raw.get("dtype") or raw.get("torch_dtype")
        st, pt = self.path / "model.safetensors", self.path / "pytorch_model.bin"
        if st.exists():
            self._file = _open(st)
            self.keys = set(self._file.keys())
            self._get = self._file.get_tensor
        elif (self.path / "model.safetensors.index.json").exists():  # sharded (Llama 8B, 70B)
            index = json.loads((self.path / "model.safetensors.index.json").read_text())
            weight_map: dict[str, str] = index["weight_map"]
            opened: dict[str, object] = {}

            def get(key: str) -> torch.Tensor:
                fname = weight_map[key]
                if fname not in opened:
                    opened[fname] = _open(self.path / fname)
                return opened[fname].get_tensor(key)

            self.keys = set(weight_map)
            self._get = get
        elif pt.exists():
            state = _load_pickled_weights(pt)
            self.keys = set(state)
            self._get = state.__getitem__
        else:
            raise FileNotFoundError(f"{self.path}: neither model.safetensors (or its sharded "
                                    f"index) nor pytorch_model.bin found")
        self.prefix = self._detect_prefix()

    @classmethod
    def from_model(cls, hf_model) -> "HFReader":
        """Read an in-memory transformers model (GPT2LMHeadModel, BertForMaskedLM, ...)."""

        self = cls.__new__(cls)
        self.path = Path(f"<{type(hf_model).__name__}>")
        self.config = config_from_hf(hf_model.config)
        state = hf_model.state_dict()
        self.keys = set(state)
        self._get = lambda k: state[k].detach().cpu()
        self._saved_dtype = None
        self.prefix = self._detect_prefix()
        return self

    @property
    def dtype(self) -> str:
        """The dtype of the weights ("bfloat16", "float32", ...): config.json's ``dtype`` (or
        ``torch_dtype``), else the word embedding's. An export writes this dtype by default."""
        if isinstance(self._saved_dtype, str) and self._saved_dtype != "auto":
            return self._saved_dtype.removeprefix("torch.")
        probe = {"gpt2": "wte.weight", "llama": "embed_tokens.weight"}.get(
            self.config.model_type, "embeddings.word_embeddings.weight")
        return str(self.get(probe).dtype).removeprefix("torch.")

    def _detect_prefix(self) -> str:
        probe = {"gpt2": "wte.weight", "llama": "embed_tokens.weight"}.get(
            self.config.model_type, "embeddings.word_embeddings.weight")
        for prefix in ("transformer.", "bert.", "model.", ""):
            if prefix + probe in self.keys:
                return prefix
        raise ConfigError(f"{self.path}: not a {self.config.model_type} checkpoint "
                          f"(no {probe} found)")

    def get(self, key: str) -> torch.Tensor:
        """An HF tensor by its name (without the model prefix for base-model tensors)."""
        for k in (self.prefix + key, key):
            if k in self.keys:
                return self._get(k)
        raise KeyError(key)

    def canonical(self, name: str) -> torch.Tensor:
        """The full canonical tensor `name`, converted from the HF tensors."""
        fn = _CANONICAL[self.config.model_type]
        return fn(name, self.get, self.config).contiguous()


# --- GPT-2 ---------------------------------------------------------------------------------
_GPT2_TOP = {"embed.word.weight": "wte.weight", "embed.position.weight": "wpe.weight",
             "final_norm.weight": "ln_f.weight", "final_norm.bias": "ln_f.bias"}
_GPT2_LAYER = {"ln_1": "ln_1", "ln_2": "ln_2", "attn.proj": "attn.c_proj", "mlp.fc": "mlp.c_fc",
               "mlp.proj": "mlp.c_proj"}


def _gpt2_canonical(name: str, get: Getter, config) -> torch.Tensor:
    if name in _GPT2_TOP:
        return get(_GPT2_TOP[name])
    i, rest = _LAYER.fullmatch(name).groups()
    module, kind = rest.rsplit(".", 1)
    if module == "attn.qkv":
        fused = get(f"h.{i}.attn.c_attn.{kind}")
        return fuse_heads((fused.T if kind == "weight" else fused).chunk(3), config.n_head)
    tensor = get(f"h.{i}.{_GPT2_LAYER[module]}.{kind}")
    conv1d = module != "ln_1" and module != "ln_2"
    return tensor.T if conv1d and kind == "weight" else tensor


def _gpt2_to_hf(canonical: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
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
_BERT_TOP = {"embed.word": "embeddings.word_embeddings",
             "embed.position": "embeddings.position_embeddings",
             "embed.token_type": "embeddings.token_type_embeddings",
             "embed.norm": "embeddings.LayerNorm"}
_BERT_QKV = ("attention.self.query", "attention.self.key", "attention.self.value")
_BERT_LAYER = {"attn.proj": "attention.output.dense",
               "attn_norm": "attention.output.LayerNorm", "mlp.fc": "intermediate.dense",
               "mlp.proj": "output.dense", "mlp_norm": "output.LayerNorm"}
_BERT_HEAD = {"head.transform": "cls.predictions.transform.dense",
              "head.norm": "cls.predictions.transform.LayerNorm"}


def _bert_canonical(name: str, get: Getter, config) -> torch.Tensor:
    if name == "head.bias":
        return get("cls.predictions.bias")
    module, kind = name.rsplit(".", 1)
    if module in _BERT_TOP:
        return get(f"{_BERT_TOP[module]}.{kind}")
    if module in _BERT_HEAD:
        return get(f"{_BERT_HEAD[module]}.{kind}")
    i, rest = _LAYER.fullmatch(module + "." + kind).groups()
    sub, kind = rest.rsplit(".", 1)
    if sub == "attn.qkv":
        return fuse_heads([get(f"encoder.layer.{i}.{hf}.{kind}") for hf in _BERT_QKV],
                          config.num_attention_heads)
    return get(f"encoder.layer.{i}.{_BERT_LAYER[sub]}.{kind}")


def _bert_to_hf(canonical: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    out = {}
    for ours, hf in _BERT_TOP.items():
        for kind in ("weight", "bias") if ours == "embed.norm" else ("weight",):
            out[f"bert.{hf}.{kind}"] = canonical[f"{ours}.{kind}"]
    for i in range(config.num_hidden_layers):
        for ours, hf in _BERT_LAYER.items():
            for kind in ("weight", "bias"):
                out[f"bert.encoder.layer.{i}.{hf}.{kind}"] = canonical[f"layers.{i}.{ours}.{kind}"]
        for kind in ("weight", "bias"):
            parts = unfuse_heads(canonical[f"layers.{i}.attn.qkv.{kind}"],
                                 config.num_attention_heads)
            for hf, t in zip(_BERT_QKV, parts):
                out[f"bert.encoder.layer.{i}.{hf}.{kind}"] = t
    for ours, hf in _BERT_HEAD.items():
        for kind in ("weight", "bias"):
            out[f"{hf}.{kind}"] = canonical[f"{ours}.{kind}"]
    out["cls.predictions.bias"] = canonical["head.bias"]
    return out


# --- Llama ---------------------------------------------------------------------------------
_LLAMA_TOP = {"embed.word.weight": "embed_tokens.weight", "final_norm.weight": "norm.weight"}
_LLAMA_LAYER = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm",
                "attn.q": "self_attn.q_proj", "attn.k": "self_attn.k_proj",
                "attn.v": "self_attn.v_proj", "attn.proj": "self_attn.o_proj",
                "mlp.gate": "mlp.gate_proj", "mlp.up": "mlp.up_proj", "mlp.down": "mlp.down_proj"}


def _llama_canonical(name: str, get: Getter, config) -> torch.Tensor:
    """Same layout as transformers (nn.Linear weights, no fusing): only the names differ."""
    if name == "head.weight":  # untied head; a tied model has no lm_head to read
        return get("lm_head.weight")
    if name in _LLAMA_TOP:
        return get(_LLAMA_TOP[name])
    i, rest = _LAYER.fullmatch(name).groups()
    module, kind = rest.rsplit(".", 1)
    return get(f"layers.{i}.{_LLAMA_LAYER[module]}.{kind}")


def _llama_to_hf(canonical: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    out = {"model." + hf: canonical[ours] for ours, hf in _LLAMA_TOP.items()}
    for i in range(config.num_hidden_layers):
        for ours, hf in _LLAMA_LAYER.items():
            out[f"model.layers.{i}.{hf}.weight"] = canonical[f"layers.{i}.{ours}.weight"]
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = canonical["head.weight"]
    return out


_CANONICAL = {"gpt2": _gpt2_canonical, "bert": _bert_canonical, "llama": _llama_canonical}
_TO_HF = {"gpt2": _gpt2_to_hf, "bert": _bert_to_hf, "llama": _llama_to_hf}
ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "bert": "BertForMaskedLM",
                 "llama": "LlamaForCausalLM"}
"""The transformers class megapar trains and exports, per model type."""


# --- megapar models <-> HF -----------------------------------------------------------------
@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, reader: HFReader) -> list[str]:
    """Copy this rank's shard of every parameter from an HF checkpoint into `model`.

    Returns the canonical names the checkpoint lacks (e.g. the MLM head of a plain BertModel);
    those parameters keep the values they had (call `model.init_weights(seed)` first).
    """
    missing = []
    tp_rank = model.mesh.tp_rank
    for name, param in model.named_parameters():
        source = getattr(param, "tied_to", name)
        try:
            full = reader.canonical(source)
        except KeyError:
            missing.append(source)
            continue
        dim = getattr(param, "tp_dim", None)
        if tuple(full.shape) != tuple(getattr(param, "full_shape", param.shape)):
            raise ConfigError(f"{reader.path}: {source} has shape {tuple(full.shape)}, the model "
                              f"expects {param.full_shape}")
        local = param.shape[dim] if dim is not None else None
        param.copy_(shard_of(full.to(param.dtype), dim, local, tp_rank))
    return missing


def to_hf_state(canonical: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """transformers' state dict (GPT2LMHeadModel / BertForMaskedLM / LlamaForCausalLM names)
    from canonical tensors."""
    fn = _TO_HF[config.model_type]
    return {k: v.contiguous() for k, v in fn(canonical, config).items()}


HF_FILES = ("model.safetensors", "config.json")
"""The files an export writes (and replaces); anything else in the directory is left alone."""


def save_hf(canonical: dict[str, torch.Tensor], config, out_dir: str | Path,
            tokenizer=None, dtype: torch.dtype | None = None) -> Path:
    """Write config.json + model.safetensors into `out_dir` (created if missing), which
    transformers' `from_pretrained` loads, and, given a megapar `tokenizer`, that tokenizer in
    transformers' format (`save_for_transformers`: checked to encode as megapar does), so
    `AutoTokenizer.from_pretrained(out_dir)` works too. `dtype`: the weights' dtype in the
    files (default: as given), recorded as the config's ``dtype``. As `save_pretrained`, other
    files there (notes) are left alone; each file is written under a temporary name and renamed
    when complete (the tokenizer, then the weights), so an interrupted export never leaves a
    half-written file."""

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if tokenizer is not None:
        save_for_transformers(tokenizer, str(out_dir), config.vocab_size,
                              sentence_pairs=config.model_type == "bert")
    if dtype is not None:
        canonical = {k: v.to(dtype) for k, v in canonical.items()}
    tmp = {name: out_dir / f".{name}.tmp-{os.getpid()}" for name in HF_FILES}
    try:
        hf_config = config.to_hf()
        hf_config.dtype = str(next(iter(canonical.values())).dtype).removeprefix("torch.")
        hf_config.architectures = [ARCHITECTURES[config.model_type]]
        hf_config.tie_word_embeddings = getattr(config, "tie_word_embeddings", True)
        for special in ("bos_token_id", "eos_token_id", "pad_token_id"):  # GPT-2's 50256
            value = getattr(hf_config, special, None)  # means nothing in another vocabulary
            if isinstance(value, int) and value >= config.vocab_size:
                setattr(hf_config, special, None)
        save_file(to_hf_state(canonical, config), str(tmp["model.safetensors"]),
                  metadata={"format": "pt"})
        umask = os.umask(0)   # safetensors creates its file 0600: give it the usual mode
        os.umask(umask)
        os.chmod(tmp["model.safetensors"], 0o666 & ~umask)
        tmp["config.json"].write_text(hf_config.to_json_string())
        for name in HF_FILES:
            os.replace(tmp[name], out_dir / name)
    except BaseException:
        for path in tmp.values():
            path.unlink(missing_ok=True)
        raise
    return out_dir


@torch.no_grad()
def gather_canonical(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full tensors of this stage's parameters, gathered over the tp group (collective)."""

    out = {}
    for name, param in model.named_parameters():
        if hasattr(param, "tied_to"):
            continue
        out[name] = gather_full(param.detach(), getattr(param, "tp_dim", None),
                                getattr(param, "full_shape", tuple(param.shape)),
                                model.mesh.tp_group).cpu()
    return out
