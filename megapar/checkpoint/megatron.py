"""Megatron-core's ``torch_dist`` GPT checkpoints into megapar (weights only).

A Megatron-LM checkpoint root holds ``latest_checkpointed_iteration.txt`` and one directory per
save, ``iter_NNNNNNN/``. In the ``torch_dist`` format (Megatron's default) that directory is a
torch.distributed.checkpoint (DCP) checkpoint written by ``megatron.core.dist_checkpointing``:
``.metadata`` (DCP's pickled index), ``__R_S.distcp`` data files, ``metadata.json`` (the
sharded backend's name and version, JSON) and ``common.pt``: a ``torch.save`` pickle of what is
not sharded (the training loop's ``args`` namespace, the iteration, the checkpoint version, the
optimizer's parameter groups and the learning-rate scheduler's state). megapar never unpickles
it: `read_args` walks its pickle with `_ArgsUnpickler`, which builds ``argparse.Namespace``,
plain containers and torch dtypes and stands an inert `_Opaque` record in for every other class
or function it names (nothing of the file's runs), to take the model's settings from the
training ``args`` where ``--model`` does not give them (`config_from_args`). Either way every
size is checked against the tensors.

The tensors are named by the model's sharded state dict, its layers stacked along a leading axis
(``decoder.layers.self_attention.linear_qkv.weight`` is [layers, rows, hidden]); each layer is
read on its own (`_LayerPlanner`), so memory holds one layer's tensor at a time. Names:

- ``embedding.word_embeddings.weight`` (vocabulary padded as Megatron padded it),
  ``embedding.position_embeddings.weight`` (learned positions only), ``output_layer.weight``
  (an untied head only), ``decoder.final_layernorm.weight`` / ``.bias``;
- per layer ``self_attention.linear_qkv.weight`` / ``.bias``: query groups one after another,
  each [its query heads, one key head, one value head], head_dim rows each (Megatron's
  ``num_query_groups``; with as many groups as heads this is megapar's fused head-major
  ``attn.qkv``); ``self_attention.linear_proj``; ``mlp.linear_fc1`` ([gate; up] for SwiGLU) and
  ``mlp.linear_fc2``;
- the norm before attention / MLP as ``self_attention.linear_qkv.layer_norm_weight`` and
  ``mlp.linear_fc1.layer_norm_weight`` (``_bias``): Transformer Engine's fused names, which
  Megatron's local spec also saves under; older local-spec checkpoints' ``input_layernorm`` and
  ``pre_mlp_layernorm`` are read too;
- a mixture of experts' layer instead of the MLP: ``mlp.router.weight`` [experts, hidden] (and
  ``mlp.router.expert_bias`` with ``--moe-router-enable-expert-bias``), the routed experts
  stacked ``mlp.experts.experts.linear_fc1.weight`` [experts, gate; up, hidden] and
  ``linear_fc2.weight`` [experts, hidden, size]: the one global name SequentialMLP
  (``local_experts.N``), GroupedMLP (``weight1`` / ``weight2``, transposed back) and TEGroupedMLP
  (``linear_fc1.weightN``) all save under, whatever the expert parallelism; a shared expert's
  ``mlp.shared_experts.linear_fc1`` / ``linear_fc2``.

Megatron's rotary positions are on the halves of each head (``rotary_interleaved`` off, its
default), as megapar's and transformers' are, so no tensor is permuted. A model with learned
positions, LayerNorm, biases, a non-gated MLP and a tied head is megapar's GPT-2; one with RoPE,
RMSNorm, SwiGLU and no biases is its Llama, or its Mixtral with SwiGLU experts in every layer
(Megatron's router with softmax scores over the top-k logits, or sigmoid scores normalised over
the top k, either with the expert bias choosing: what megapar's router computes); anything else
(MLA, QK layernorm, dense layers among MoE ones, a routing megapar's router does not compute,
other combinations) is refused in one line, and so is the legacy format
(``mp_rank_XX/model_optim_rng.pt``, a pickle).
"""

from __future__ import annotations

import argparse
import json
import pickle
import re
import zipfile
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megapar.checkpoint.convert import write_weights
from megapar.checkpoint.dcp import METADATA, _MetadataUnpickler, load_data
from megapar.checkpoint.dcp import _Reader as _DCPReader
from megapar.checkpoint.format import CheckpointError
from megapar.mesh import Layout
from megapar.models.config import ConfigError, config_from_dict
from megapar.models.recipes import resolve_model
from megapar.one_line_parser import shell_word
from megapar.wording import first_few

TRACKER = "latest_checkpointed_iteration.txt"
"""The file of a Megatron-LM checkpoint root naming its newest save."""
_ITER = re.compile(r"iter_(\d{7})")
_L = "decoder.layers."
_TO_TORCH_DIST = (
    "convert it to torch_dist with Megatron-LM itself: run your training script "
    "(pretrain_gpt.py) as before with --load {path} --ckpt-convert-format torch_dist "
    "--ckpt-convert-save NEW_DIR, then give NEW_DIR here"
)
_NORM_SPELLINGS = {
    "attn_norm": ("self_attention.linear_qkv.layer_norm_", "input_layernorm."),
    "mlp_norm": ("mlp.linear_fc1.layer_norm_", "pre_mlp_layernorm."),
}
"""A layer's norms: Transformer Engine's fused name (also the local spec's since Megatron-core
0.x's key map) and the local spec's own older one; + ``weight`` / ``bias``."""


_LACKED = {
    "multi-latent attention (MLA)": ("linear_q_down_proj", "linear_kv_down_proj"),
    "multi-token prediction": ("mtp.",),
    "QK layernorm": ("q_layernorm", "k_layernorm"),
    "a gated shared expert (--moe-shared-expert-gate; megapar's shared experts have no gate)": (
        ".mlp.shared_experts.gate_weight",
    ),
    "expert biases (--add-bias-linear with experts; megapar's Mixtral has no biases)": (
        ".mlp.router.bias",
        ".mlp.experts.experts.linear_fc1.bias",
        ".mlp.experts.experts.linear_fc2.bias",
    ),
}
"""Megatron GPT options megapar's import has no place for, by a mark in their tensors' names."""
_PER_LAYER = re.compile(r"decoder\.layers\.\d+\.")
"""A layer saved under its own key (``decoder.layers.3.…``) instead of stacked: what Megatron
writes for layers that differ (``--moe-layer-freq`` with dense layers among the MoE ones, a
heterogeneous model) or with ``singleton_local_shards``."""
_ROUTER, _EXPERTS = f"{_L}mlp.router.", f"{_L}mlp.experts.experts."
_LOOKS = {"gpt2": "learned positions", "llama": "RoPE, SwiGLU", "mixtral": "RoPE, SwiGLU experts"}
_SHARED = f"{_L}mlp.shared_experts."


class _MegatronMetadataUnpickler(_MetadataUnpickler):
    """DCP's metadata classes plus the save plans Megatron-core caches in its ``.metadata``
    (``torch.distributed.checkpoint.planner``'s ``SavePlan`` / ``WriteItem`` dataclasses and
    enum); nothing else."""

    _PLANNER = frozenset({"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"})

    def find_class(self, module, name):
        if module == "torch.distributed.checkpoint.planner" and name in self._PLANNER:
            return pickle.Unpickler.find_class(self, module, name)
        return super().find_class(module, name)


class _Reader(_DCPReader):
    """`dcp._Reader` whose ``.metadata`` is read by `_MegatronMetadataUnpickler` (given once
    read: Megatron's caches every rank's save plan, so it grows with the job)."""

    unpickler = _MegatronMetadataUnpickler


class _LayerPlanner(DefaultLoadPlanner):
    """Reads row `index` of the leading (layer) axis of tensor `key` into a [1, ...] tensor."""

    def __init__(self, key: str, index: int):
        super().__init__()
        self.key, self.index = key, index

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None  # set_up_planner gave it
        entry = self.metadata.state_dict_metadata[self.key]
        assert isinstance(entry, TensorStorageMetadata)  # MegatronReader reads tensors only
        rest = list(entry.size)[1:]
        chunk = ChunkStorageMetadata(
            offsets=torch.Size([self.index] + [0] * len(rest)), sizes=torch.Size([1, *rest])
        )
        return LoadPlan(create_read_items_for_chunk_list(self.key, entry, [chunk]))

    def lookup_tensor(self, index):
        return self.state_dict[index.fqn]


def _legacy(p: Path) -> bool:
    return (p / "model_optim_rng.pt").is_file() or any(p.glob("mp_rank_*"))


def _root_of(p: Path) -> Path:
    """The checkpoint root a directory of a Megatron-LM save belongs to (what Megatron's
    --load takes): the nearest of `p` and its parents holding `TRACKER`; else, for an
    mp_rank_XX or iter_NNNNNNN directory, the directory above its iteration."""
    for a in (p, *p.parents):
        if (a / TRACKER).is_file():
            return a
    if p.name.startswith("mp_rank_"):
        p = p.parent
    return p.parent if _ITER.fullmatch(p.name) or p.name == "release" else p


def resolve_iteration(path: str | Path) -> Path:
    """The ``iter_NNNNNNN`` (or ``release``) directory `path` names: itself, or the one a
    checkpoint root's ``latest_checkpointed_iteration.txt`` names; refuses the legacy format,
    other sharded backends and anything else in one line."""
    p = Path(path).expanduser()
    if p.is_file() and p.name == "model_optim_rng.pt":
        p = p.parent  # the legacy pickle itself: refused below as its directory is
    elif not p.is_dir():
        what = "is a file" if p.exists() else "does not exist"
        raise CheckpointError(
            f"--from-megatron {path} {what}; give a Megatron-LM checkpoint root (with "
            f"{TRACKER}) or one iter_NNNNNNN directory"
        )
    if (p / TRACKER).is_file():
        text = (p / TRACKER).read_text().strip()
        if text == "release":
            name = "release"
        elif text.isdigit():
            name = f"iter_{int(text):07d}"
        else:
            raise CheckpointError(
                f"--from-megatron {path}: {TRACKER} holds {text!r}, not an iteration; give "
                f"the iter_NNNNNNN directory itself"
            )
        if not (p / name).is_dir():
            raise CheckpointError(
                f"--from-megatron {path}: {TRACKER} names {name}, which is not there; give "
                f"an iter_NNNNNNN directory that is"
            )
        p = p / name
    elif not (p / "metadata.json").is_file() and not _legacy(p):
        iters = sorted(d.name for d in p.glob("iter_*") if d.is_dir())
        if iters:
            raise CheckpointError(
                f"--from-megatron {path}: a Megatron checkpoint root without {TRACKER}; give "
                f"one of its saves, e.g. {shell_word(p / iters[-1])}"
            )
    if _legacy(p):
        raise CheckpointError(
            f"--from-megatron {path}: Megatron's legacy torch format "
            f"(mp_rank_XX/model_optim_rng.pt, a pickle megapar does not load); "
            + _TO_TORCH_DIST.format(path=shell_word(_root_of(p)))
        )
    info = p / "metadata.json"
    if not info.is_file():
        raise CheckpointError(
            f"--from-megatron {path}: not a Megatron torch_dist checkpoint (no metadata.json); "
            f"give a checkpoint root (with {TRACKER}) or one iter_NNNNNNN directory"
        )
    try:
        data = json.loads(info.read_text())
    except ValueError as exc:  # damaged: no other backend to convert from
        raise CheckpointError(
            f"--from-megatron {path}: {info} is not readable JSON ({exc}): the checkpoint is "
            f"damaged; copy it again from where it was written"
        ) from None
    backend = data.get("sharded_backend") if isinstance(data, dict) else None
    if backend != "torch_dist":
        raise CheckpointError(
            f"--from-megatron {path}: {info.name} names the sharded backend {backend!r}; "
            f"megapar reads torch_dist checkpoints: " + _TO_TORCH_DIST.format(path=shell_word(path))
        )
    if not (p / METADATA).is_file():
        raise CheckpointError(
            f"--from-megatron {path}: {p.name} has no .metadata (an interrupted save?); give "
            f"another iteration"
        )
    return p


class _Opaque:
    """What `_ArgsUnpickler` builds for a class or function it does not admit: a record of the
    name and of the arguments it was to be called with, calling nothing."""

    name: ClassVar[str] = "?"

    def __init__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state):
        self.state = state

    def __repr__(self) -> str:
        return f"<{self.name}>"


class _ArgsUnpickler(pickle.Unpickler):
    """Reads a ``torch.save`` pickle's objects without running any of its code: builds
    ``argparse.Namespace``, OrderedDict, sets, slices and torch dtypes; any other global becomes
    an `_Opaque` subclass named after it (an enum member, a tensor's rebuild, a function), and a
    tensor's storage is never read."""

    def find_class(self, module, name):
        if (module, name) == ("argparse", "Namespace"):
            return argparse.Namespace
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        if module == "builtins" and name in ("set", "frozenset", "slice"):
            return {"set": set, "frozenset": frozenset, "slice": slice}[name]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        return type(name, (_Opaque,), {"name": f"{module}.{name}"})

    def persistent_load(self, pid):
        return _Opaque(*pid) if isinstance(pid, tuple) else _Opaque(pid)


def read_args(path: Path) -> argparse.Namespace | None:
    """The training ``args`` a Megatron ``common.pt`` records (its values: plain data; an enum or
    other object an inert `_Opaque`), read by `_ArgsUnpickler`; None where there are none."""
    try:
        with zipfile.ZipFile(path) as z:
            name = next((n for n in z.namelist() if n.endswith("/data.pkl")), None)
            if name is None:
                return None
            with z.open(name) as f:
                common = _ArgsUnpickler(f).load()
    except (OSError, zipfile.BadZipFile, pickle.UnpicklingError, EOFError, ValueError,
            TypeError, AttributeError, IndexError, KeyError, RecursionError):  # fmt: skip
        return None
    args = common.get("args") if isinstance(common, dict) else None
    return args if isinstance(args, argparse.Namespace) else None


def config_from_args(args: argparse.Namespace, vocab: int, where: Path):
    """A megapar GPT-2, Llama or Mixtral config from Megatron's training `args` (its names),
    `vocab` the checkpoint's embedding rows; a setting megapar's models lack refused."""

    def arg(name: str, default: Any = None) -> Any:
        return getattr(args, name, default)

    def lacks(what: str) -> ConfigError:
        return ConfigError(
            f"{where}: its args say {what}, which megapar's models lack; refused (or give "
            f"--model SPEC if you know better)"
        )

    kind = arg("position_embedding_type", "learned_absolute")
    heads, hidden = arg("num_attention_heads"), arg("hidden_size")
    if not isinstance(heads, int) or not isinstance(hidden, int):
        raise ConfigError(
            f"{where}: common.pt's args lack num_attention_heads / hidden_size; give --model SPEC"
        )
    eps = arg("norm_epsilon", arg("layernorm_epsilon", 1e-5))
    if arg("squared_relu"):
        raise lacks("--squared-relu")
    if kind == "learned_absolute":
        if arg("group_query_attention") and arg("num_query_groups") not in (None, heads):
            raise lacks("query groups with learned positions")
        if arg("kv_channels") not in (None, hidden // heads):  # GPT-2's heads split hidden
            raise lacks(
                f"--kv-channels {arg('kv_channels')} with learned positions (GPT-2's heads "
                f"are hidden {hidden} / {heads} heads = {hidden // heads} wide)"
            )
        return config_from_dict(
            {
                "model_type": "gpt2",
                "vocab_size": vocab,
                "n_positions": arg("max_position_embeddings"),
                "n_embd": hidden,
                "n_layer": arg("num_layers"),
                "n_head": heads,
                "n_inner": arg("ffn_hidden_size"),
                "activation_function": "gelu_new" if arg("openai_gelu") else "gelu",
                "layer_norm_epsilon": eps,
                "resid_pdrop": arg("hidden_dropout", 0.1),
                "embd_pdrop": arg("hidden_dropout", 0.1),
                "attn_pdrop": arg("attention_dropout", 0.1),
            }
        )
    if kind != "rope":
        raise lacks(f"--position-embedding-type {kind}")
    if arg("rotary_interleaved"):
        raise lacks("--rotary-interleaved")
    if arg("rotary_percent", 1.0) != 1.0:
        raise lacks(f"--rotary-percent {arg('rotary_percent')}")
    if arg("use_rope_scaling"):
        raise lacks("--use-rope-scaling (give --model with its rope_scaling)")
    kv_channels = arg("kv_channels")
    moe = _moe_from_args(args, lacks) if arg("num_experts") else {}
    llama = {
        "model_type": "mixtral" if moe else "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": arg("ffn_hidden_size"),
        "num_hidden_layers": arg("num_layers"),
        "num_attention_heads": heads,
        "num_key_value_heads": arg("num_query_groups") or heads
        if arg("group_query_attention")
        else heads,
        "head_dim": kv_channels if kv_channels not in (None, hidden // heads) else None,
        "max_position_embeddings": arg("max_position_embeddings") or arg("seq_length"),
        "rms_norm_eps": eps,
        "rope_theta": float(arg("rotary_base", 10000)),
        "attention_dropout": arg("attention_dropout", 0.0),
        "tie_word_embeddings": not arg("untie_embeddings_and_output_weights", False),
    }
    return config_from_dict({**llama, **moe})


_MOE_REFUSED = {
    "moe_router_topk_scaling_factor": " (the top-k weights scaled)",
    "moe_router_num_groups": " (group-limited routing)",
    "moe_router_group_topk": " (group-limited routing)",
    "moe_router_topk_limited_devices": " (device-limited routing)",
    "moe_router_force_load_balancing": " (random routing, for benchmarks)",
    "moe_latent_size": " (experts in a latent dimension)",
    "moe_expert_capacity_factor": (
        " (Megatron drops by --moe-token-drop-policy, megapar keeps each expert's first "
        "tokens; --model with a moe_capacity_factor of your choice imports the weights)"
    ),
    "moe_input_jitter_eps": " (the router's input jittered)",
    "moe_shared_expert_gate": " (megapar's shared experts have no gate)",
    "moe_apply_probs_on_input": " (the weights applied before the experts)",
}
"""Megatron's MoE args (set, other than their defaults) whose routing or experts megapar's
Mixtral does not compute, with what they do."""


def _moe_from_args(args: argparse.Namespace, lacks) -> dict:
    """The Mixtral fields of Megatron's MoE `args` (``--num-experts`` set): the router megapar's
    Mixtral computes, the balancing coefficients in megapar's per-layer mean; a routing it does
    not compute refused by `lacks` (naming Megatron's option)."""

    def arg(name: str, default: Any = None) -> Any:
        return getattr(args, name, default)

    topk, score = arg("moe_router_topk", 2), arg("moe_router_score_function", "softmax")
    balancing = arg("moe_router_load_balancing_type", "aux_loss")
    types = balancing if isinstance(balancing, list) else [balancing]
    coeffs = arg("moe_aux_loss_coeff", 0.0)
    coeffs = coeffs if isinstance(coeffs, list) else [coeffs] * len(types)
    if arg("moe_layer_freq", 1) not in (1, None, [1] * arg("num_layers", 0)):
        raise lacks(f"--moe-layer-freq {arg('moe_layer_freq')} (dense layers among the MoE ones)")
    if score not in ("softmax", "sigmoid"):
        raise lacks(f"--moe-router-score-function {score}")
    if score == "softmax" and arg("moe_router_pre_softmax"):
        raise lacks(
            "--moe-router-pre-softmax (the top k of a softmax over all experts, not "
            "renormalised; megapar's Mixtral takes the softmax of the top k logits)"
        )
    if score == "sigmoid" and topk == 1:
        raise lacks(
            "--moe-router-score-function sigmoid with --moe-router-topk 1 (the one score not "
            "normalised; megapar's Mixtral normalises the top k)"
        )
    if "sinkhorn" in types:
        raise lacks("--moe-router-load-balancing-type sinkhorn (it routes by Sinkhorn in training)")
    for name, why in _MOE_REFUSED.items():
        value = arg(name)
        if value not in (None, False) and not (
            name == "moe_router_topk_scaling_factor" and value == 1
        ):
            flag = "--" + name.replace("_", "-")
            raise lacks(f"{flag}{'' if value is True else f' {value}'}{why}")
    layers = arg("num_layers") or 0
    aux = sum(c or 0.0 for t, c in zip(types, coeffs) if t == "aux_loss")
    return {
        "num_local_experts": arg("num_experts"),
        "num_experts_per_tok": topk,
        "intermediate_size": arg("moe_ffn_hidden_size") or arg("ffn_hidden_size"),
        "moe_router_score": score,
        # Megatron adds each layer's coefficient x loss; megapar's coefficient is of the mean
        "router_aux_loss_coef": aux * layers,
        "moe_z_loss_coef": (arg("moe_z_loss_coeff") or 0.0) * layers,
        "moe_bias_update_rate": arg("moe_router_bias_update_rate", 1e-3)
        if arg("moe_router_enable_expert_bias")
        else 0.0,
        "shared_expert_intermediate_size": arg("moe_shared_expert_intermediate_size"),
    }


class MegatronReader:
    """The weights of a Megatron-core torch_dist GPT checkpoint as megapar's canonical tensors
    (`canonical`); `config` is the GPT-2, Llama or Mixtral they belong to (from `config`, a model
    spec or config, else from the training args common.pt records; its sizes checked against
    the tensors and its vocabulary the checkpoint's)."""

    def __init__(self, path: str | Path, config):
        self.given = Path(path).expanduser()
        self.path = resolve_iteration(path)
        self.metadata = metadata = _Reader(self.path).read_metadata()
        self.last: tuple[tuple[str, int | None], torch.Tensor] | None = None
        """The last tensor read (a layer's linear_qkv serves q, k and v; linear_fc1 gate, up)."""
        entries = metadata.state_dict_metadata
        self.tensors = {k: v for k, v in entries.items() if isinstance(v, TensorStorageMetadata)}
        m = _ITER.fullmatch(self.path.name)
        self.iteration = int(m.group(1)) if m else None
        self.optimizer = any(k.startswith("optimizer.") for k in entries)
        if "embedding.word_embeddings.weight" not in self.tensors:
            shown = ", ".join(sorted(self.tensors)[:4]) or "none"
            raise CheckpointError(
                f"{self.path}: a torch_dist checkpoint without a GPT's "
                f"embedding.word_embeddings.weight (tensors: {shown}); megapar reads "
                f"Megatron's GPT models"
            )
        self.spec_vocab: int | None = None
        """--model's vocabulary where it was not the checkpoint's (which the import takes)."""
        self.from_args = False
        """Whether the config came from common.pt's training args (no --model given)."""
        self.config = self._config(config)
        self.sources = self._sources()

    def shape(self, key: str) -> list[int] | None:
        entry = self.tensors.get(key)
        return None if entry is None else list(entry.size)

    def _norm_key(self, which: str, kind: str) -> str:
        fused, local = _NORM_SPELLINGS[which]
        return _L + (local + kind if _L + local + kind in self.tensors else fused + kind)

    def _architecture(self) -> str:
        """ "gpt2", "llama" or "mixtral" from the tensors present, else the one-line refusal."""
        for what, marks in _LACKED.items():
            hit = next((k for k in sorted(self.tensors) if any(m in k for m in marks)), None)
            if hit is not None:
                raise ConfigError(
                    f"{self.path}: a GPT with {what} ({hit}); megapar imports Megatron GPTs "
                    f"that are its GPT-2, Llama or Mixtral"
                )
        single = next((k for k in sorted(self.tensors) if _PER_LAYER.match(k)), None)
        if single is not None:
            raise ConfigError(
                f"{self.path}: its layers are saved one by one ({single}), as Megatron saves "
                f"layers that differ (--moe-layer-freq with dense layers, a heterogeneous "
                f"model); megapar imports GPTs whose layers are all alike (stacked "
                f"decoder.layers.* tensors)"
            )
        has = self.tensors.__contains__
        learned = has("embedding.position_embeddings.weight")
        moe = has(_ROUTER + "weight")
        mlp = _EXPERTS if moe else _L + "mlp."
        fc1, fc2 = (self.shape(mlp + "linear_fc1.weight"), self.shape(mlp + "linear_fc2.weight"))
        gated = fc1 is not None and fc2 is not None and fc1[-2] == 2 * fc2[-1]
        linear_bias = [
            has(_L + f"{m}.bias")
            for m in ("self_attention.linear_qkv", "self_attention.linear_proj")
            + ("mlp.linear_fc1", "mlp.linear_fc2")
        ]
        if moe:
            linear_bias = linear_bias[:2]
        norm_bias = has("decoder.final_layernorm.bias")
        tied = not has("output_layer.weight")
        biases = (
            "biases" if all(linear_bias) else "some biases" if any(linear_bias) else "no biases"
        )
        traits = (
            f"{'learned' if learned else 'no learned'} positions, "
            f"{'LayerNorm' if norm_bias else 'RMSNorm'}, "
            f"{'gated (SwiGLU)' if gated else 'plain'} MLP, {biases}, "
            f"{'tied' if tied else 'untied'} head"
        )
        if learned and norm_bias and not gated and all(linear_bias):
            if not tied:
                raise ConfigError(
                    f"{self.path}: a GPT with learned positions and an untied output_layer "
                    f"(--untie-embeddings-and-output-weights); megapar's GPT-2 ties its head to "
                    f"the embedding"
                )
            return "gpt2"
        if not learned and not norm_bias and gated and not any(linear_bias):
            return "mixtral" if moe else "llama"
        raise ConfigError(
            f"{self.path}: a GPT with {traits}{' (a mixture of experts)' if moe else ''}; "
            f"megapar reads Megatron GPTs that are its GPT-2 (learned positions, LayerNorm, "
            f"plain GELU MLP, biases, tied head), its Llama (RoPE, RMSNorm, SwiGLU, no biases) "
            f"or its Mixtral (the Llama with SwiGLU experts)"
        )

    def _config(self, config):
        """The model: `config` (a megapar spec) with the checkpoint's vocabulary, checked
        against the tensors' architecture and shapes."""
        arch = self._architecture()
        vocab = self.shape("embedding.word_embeddings.weight")[0]
        if config is None:
            args = read_args(self.path / "common.pt")
            if args is None:
                raise ConfigError(
                    f"--from-megatron {self.given}: its common.pt records no training args; "
                    f"say which model this is with --model SPEC (a megapar recipe or "
                    f"config.json of a {arch} with the heads, query groups, epsilon and rotary "
                    f"base it trained with): the tensors give only the sizes"
                )
            try:
                config = config_from_args(args, vocab, self.path)
            except TypeError as exc:  # a value of another type than Megatron's
                raise ConfigError(
                    f"{self.path}: common.pt's args do not describe a model megapar reads "
                    f"({exc}); give --model SPEC"
                ) from None
            except ConfigError as exc:
                if str(exc).startswith(str(self.path)):  # config_from_args' own refusal
                    raise
                raise ConfigError(
                    f"{self.path}: common.pt's args: {exc}; give --model SPEC"
                ) from None
            self.from_args = True
        if isinstance(config, str):
            config = resolve_model(config)
        source = "common.pt's args describe" if self.from_args else "--model is"
        if config.model_type != arch:
            raise ConfigError(
                f"{source} a {config.model_type} model; {self.path} holds a {arch}-like GPT "
                f"({_LOOKS[arch]}): give a {arch} config"
            )
        changes: dict = {"vocab_size": vocab}
        if arch != "gpt2":
            changes["tie_word_embeddings"] = "output_layer.weight" not in self.tensors
        if vocab != config.vocab_size:
            self.spec_vocab = config.vocab_size
        config = config_from_dict({**config.to_dict(), **changes})
        expected = self._expected_shapes(config)
        extra = sorted(
            k
            for k in self.tensors
            if k not in expected and not k.startswith(("optimizer.", "rng_state"))
        )
        if extra:
            hint = (
                " (an expert bias: give a config with moe_bias_update_rate > 0)"
                if any(k == _ROUTER + "expert_bias" for k in extra)
                else " (a shared expert: give a config with shared_expert_intermediate_size)"
                if any(k.startswith(_SHARED) for k in extra)
                else " (QK layernorm, MLA and other Megatron options megapar lacks)"
            )
            raise ConfigError(
                f"{self.path}: tensors megapar's {arch} has no place for: "
                f"{first_few(extra, 3)}{hint}; refused rather than dropped"
            )
        for key, want in expected.items():
            got = self.shape(key)
            if got != want:
                implied = "common.pt's args imply" if self.from_args else "--model implies"
                raise ConfigError(
                    f"{self.path}: {key} is {'missing' if got is None else got}, {implied} "
                    f"{want}; give the --model it was trained with"
                )
        return config

    def _expected_shapes(self, config) -> dict[str, list[int]]:
        """Every Megatron tensor the model `config` is made of, with its shape."""
        hidden, layers, ffn = config.hidden_size, config.num_layers, config.ffn_size
        out = {"embedding.word_embeddings.weight": [config.vocab_size, hidden]}
        if config.model_type == "gpt2":
            heads = groups = config.n_head
            head_dim, up = hidden // heads, ffn
            out["embedding.position_embeddings.weight"] = [config.n_positions, hidden]
        else:
            heads = config.num_attention_heads
            groups = config.num_key_value_heads or heads
            head_dim, up = config.head_dim or hidden // heads, 2 * ffn
            if not config.tie_word_embeddings:
                out["output_layer.weight"] = [config.vocab_size, hidden]
        bias = config.model_type == "gpt2"
        kinds = ("weight", "bias") if bias else ("weight",)
        qkv = (heads + 2 * groups) * head_dim
        for which in _NORM_SPELLINGS:
            for kind in kinds:
                out[self._norm_key(which, kind)] = [layers, hidden]
        mlp = [("mlp.linear_fc1", [up, hidden]), ("mlp.linear_fc2", [hidden, ffn])]
        if config.model_type == "mixtral":
            e, shared = config.num_local_experts, config.shared_expert_intermediate_size
            mlp = [
                ("mlp.router", [e, hidden]),
                ("mlp.experts.experts.linear_fc1", [e, up, hidden]),
                ("mlp.experts.experts.linear_fc2", [e, hidden, ffn]),
            ]
            if shared:
                mlp += [
                    ("mlp.shared_experts.linear_fc1", [2 * shared, hidden]),
                    ("mlp.shared_experts.linear_fc2", [hidden, shared]),
                ]
            if config.moe_bias_update_rate:
                out[_ROUTER + "expert_bias"] = [layers, e]
        for module, shape in (
            ("self_attention.linear_qkv", [qkv, hidden]),
            ("self_attention.linear_proj", [hidden, heads * head_dim]),
            *mlp,
        ):
            out[f"{_L}{module}.weight"] = [layers, *shape]
            if bias:
                out[f"{_L}{module}.bias"] = [layers, shape[0]]
        for kind in kinds:
            out[f"decoder.final_layernorm.{kind}"] = [hidden]
        return out

    def _sources(self) -> dict[str, tuple[str, str]]:
        """megapar's canonical name -> (Megatron key, the part of it: "" whole, or q / k / v /
        gate / up) for a layer's name with ``{i}`` for its index."""
        if self.config.model_type == "gpt2":
            top = {
                "embed.word.weight": "embedding.word_embeddings.weight",
                "embed.position.weight": "embedding.position_embeddings.weight",
                "final_norm.weight": "decoder.final_layernorm.weight",
                "final_norm.bias": "decoder.final_layernorm.bias",
            }
            layer = {}
            for kind in ("weight", "bias"):
                layer[f"ln_1.{kind}"] = (self._norm_key("attn_norm", kind), "")
                layer[f"ln_2.{kind}"] = (self._norm_key("mlp_norm", kind), "")
                layer[f"attn.qkv.{kind}"] = (f"{_L}self_attention.linear_qkv.{kind}", "")
                layer[f"attn.proj.{kind}"] = (f"{_L}self_attention.linear_proj.{kind}", "")
                layer[f"mlp.fc.{kind}"] = (f"{_L}mlp.linear_fc1.{kind}", "")
                layer[f"mlp.proj.{kind}"] = (f"{_L}mlp.linear_fc2.{kind}", "")
        else:
            top = {
                "embed.word.weight": "embedding.word_embeddings.weight",
                "final_norm.weight": "decoder.final_layernorm.weight",
                "head.weight": "output_layer.weight",
            }
            qkv, fc1 = f"{_L}self_attention.linear_qkv.weight", f"{_L}mlp.linear_fc1.weight"
            layer = {
                "attn_norm.weight": (self._norm_key("attn_norm", "weight"), ""),
                "mlp_norm.weight": (self._norm_key("mlp_norm", "weight"), ""),
                "attn.q.weight": (qkv, "q"),
                "attn.k.weight": (qkv, "k"),
                "attn.v.weight": (qkv, "v"),
                "attn.proj.weight": (f"{_L}self_attention.linear_proj.weight", ""),
            }
            if self.config.model_type == "mixtral":
                layer["mlp.router.weight"] = (_ROUTER + "weight", "")
                layer["mlp.experts.gate_up"] = (_EXPERTS + "linear_fc1.weight", "")
                layer["mlp.experts.down"] = (_EXPERTS + "linear_fc2.weight", "")
                if self.config.moe_bias_update_rate:
                    layer["mlp.router.bias"] = (_ROUTER + "expert_bias", "")
                if self.config.shared_expert_intermediate_size:
                    fc1 = _SHARED + "linear_fc1.weight"
                    layer["mlp.shared.gate.weight"] = (fc1, "gate")
                    layer["mlp.shared.up.weight"] = (fc1, "up")
                    layer["mlp.shared.down.weight"] = (_SHARED + "linear_fc2.weight", "")
            else:
                layer["mlp.gate.weight"] = (fc1, "gate")
                layer["mlp.up.weight"] = (fc1, "up")
                layer["mlp.down.weight"] = (f"{_L}mlp.linear_fc2.weight", "")
        return {**{k: (v, "") for k, v in top.items()}, **{"{i}." + k: v for k, v in layer.items()}}

    @property
    def dtype(self) -> str:
        """The dtype of the word embedding (an export writes it back)."""
        entry = self.tensors["embedding.word_embeddings.weight"]
        return str(entry.properties.dtype).removeprefix("torch.")

    def read(self, key: str, layer: int | None = None) -> torch.Tensor:
        """Tensor `key` as stored, or one `layer` of a stacked layer tensor."""
        if self.last is not None and self.last[0] == (key, layer):
            return self.last[1]
        entry = self.tensors[key]
        size = list(entry.size) if layer is None else [1, *list(entry.size)[1:]]
        out = {key: torch.empty(size, dtype=entry.properties.dtype)}
        planner = None if layer is None else _LayerPlanner(key, layer)
        load_data(out, _Reader(self.path, self.metadata), self.path, planner)
        self.last = ((key, layer), out[key] if layer is None else out[key][0])
        return self.last[1]

    def canonical(self, name: str) -> torch.Tensor:
        """megapar's canonical tensor `name`."""
        m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
        if m is None:
            key, part = self.sources[name]
            return self.read(key).contiguous()
        i, rest = int(m.group(1)), m.group(2)
        key, part = self.sources["{i}." + rest]
        tensor = self.read(key, i)
        if part in ("gate", "up"):
            tensor = tensor.chunk(2)[0 if part == "gate" else 1]
        elif part:
            tensor = self._qkv_part(tensor, part)
        return tensor.contiguous()

    def _qkv_part(self, fused: torch.Tensor, part: str) -> torch.Tensor:
        """q, k or v of a layer's ``linear_qkv`` (query groups of [q heads, k, v])."""
        config = self.config
        heads = config.num_attention_heads
        groups = config.num_key_value_heads or heads
        per = heads // groups
        rows, rest = fused.shape[0], fused.shape[1:]
        split = fused.reshape(groups, per + 2, rows // groups // (per + 2), *rest)
        taken = {"q": split[:, :per], "k": split[:, per : per + 1], "v": split[:, per + 1 :]}
        t = taken[part]
        return t.reshape(-1, *rest)


def import_megatron(
    src,
    dst,
    tp: int,
    pp: int,
    dp: int = 1,
    config=None,
    overwrite: bool = False,
    progress: bool = True,
) -> tuple[Path, MegatronReader]:
    """A megapar checkpoint (step 0, no optimizer state) from a Megatron-core torch_dist GPT
    checkpoint (a root or one ``iter_NNNNNNN`` directory), its config from `config` (a megapar
    model spec or config) or, with None, from the training args its common.pt records."""
    reader = MegatronReader(src, config)
    meta = {
        "imported_from_megatron": str(reader.path.resolve()),
        "hf_dtype": reader.dtype,
        "rng_note": "imported from a Megatron torch_dist checkpoint: weights only (no RNG "
        "states, no optimizer state)",
    }
    path = write_weights(reader, dst, Layout(tp, pp, dp), meta, overwrite, progress)
    return path, reader
