"""Hugging Face transformers checkpoints in and out (GPT2LMHeadModel, BertForMaskedLM, BertModel,
LlamaForCausalLM and the classes of Llama's layout: `hf_names.ARCHITECTURES`).

megapar's *canonical* state is the full (unsharded, unpadded) tensor of every parameter under its
megapar name (`layers.3.attn.qkv.weight`, ...), the same in every layout. This module maps between
canonical tensors and transformers' checkpoints (the names and layouts per model kind are
`megapar.checkpoint.hf_names`). Reading is lazy: a rank materialises only the tensors it asks
for, one at a time, and keeps its shard.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from megapar.checkpoint.format import CheckpointError, open_safetensors

# ARCHITECTURES and hf_parameter_names are imported from here too (`X as X`: a re-export).
from megapar.checkpoint.hf_names import ARCHITECTURES as ARCHITECTURES
from megapar.checkpoint.hf_names import (
    CANONICAL,
    DEEPSEEK_ROUTER_TYPES,
    HF_PREFIXES,
    TIED_HEAD,
    TO_HF,
)
from megapar.checkpoint.hf_names import hf_parameter_names as hf_parameter_names
from megapar.checkpoint.publish import deepspeed_checkpoint, has_checkpoint
from megapar.data.hf_tokenizer import SPECIAL_ROLES, TOKENIZER_TMP, save_for_transformers
from megapar.data.inputs import HF_WEIGHTS
from megapar.faults.processes import owner_tag, remove_stale_temporaries, stale_temporaries
from megapar.made_dirs import give_usual_mode
from megapar.mesh import Layout, Mesh
from megapar.models.config import (
    CAUSAL_LM_TYPES,
    LLAMA_TYPES,
    ConfigError,
    config_from_dict,
    config_from_hf,
    load_config_file,
)
from megapar.models.recipes import address_line, is_address, is_hub_name
from megapar.one_line_parser import shell_word
from megapar.pipeline.partition import build_stage
from megapar.tensor_parallel.partition import shard_of, tp_parts
from megapar.wording import counted


def _open(path: Path):
    """A safetensors file of a transformers directory; ConfigError when it is not one."""

    try:
        return open_safetensors(path, "weights file")
    except CheckpointError as exc:
        raise ConfigError(
            str(exc).replace("use another checkpoint", "save the model again with save_pretrained")
        ) from None


def _load_pickled_weights(path: Path) -> dict:
    """An old-style ``pytorch_model.bin``, read by torch with ``weights_only`` (tensors only:
    a pickle that would run code or build other objects is refused, in one line)."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - UnpicklingError, EOFError, RuntimeError ...
        lines = [x.strip() for x in str(exc).splitlines() if x.strip()] or [""]
        first = next(
            (x for x in lines if "GLOBAL" in x or "WeightsUnpickler" in x),
            lines[-1] if len(lines) > 1 else lines[0],
        )[:160]
        raise ConfigError(
            f"{path}: refused: not a plain pickle of weights ({type(exc).__name__}"
            f": {first}); megapar reads tensors only, never code; convert it with "
            f"transformers (from_pretrained, then save_pretrained, which writes "
            f"model.safetensors) on a machine you trust"
        ) from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError(
            f"{path}: not a state dict of tensors; save the model with save_pretrained"
        )
    return state


def _not_transformers(path: Path) -> str:
    """Why `path`, which has no config.json, is not a transformers directory, and the fix."""
    if not path.exists():
        hub_id = len(path.parts) == 2 and not path.parent.exists()  # meta-llama/Llama-3.2-1B
        if not path.is_absolute() and (hub_id or len(path.parts) == 1 and is_hub_name(str(path))):
            return (
                f"{path}: no such directory, and megapar downloads nothing (a Hugging Face Hub "
                f"id is read from a saved copy: from_pretrained({str(path)!r}).save_pretrained(DIR)"
                f" where the hub can be reached, then --from-hf DIR)"
            )
        return (
            f"{path}: no such directory; pass a transformers directory written by save_pretrained"
        )
    deepspeed = deepspeed_checkpoint(path)
    if deepspeed is not None:
        return f"{path} {deepspeed}"
    if not path.is_dir():
        return (
            f"{path} is a file, not a directory; pass the transformers directory written "
            f"by save_pretrained that holds it"
        )
    if has_checkpoint(path):
        return (
            f"{path} is a megapar checkpoint, not a transformers directory: pass it to "
            f"--load (megapar-train, megapar-eval), reshard it with megapar-convert "
            f"{shell_word(path)} DST --tp N --pp M, or export it with megapar-convert "
            f"{shell_word(path)} --to-hf HF_DIR"
        )
    weights = [name for name in HF_WEIGHTS if (path / name).is_file()]
    if weights:  # zero_to_fp32's output, torchtitan's last-save-in-hf: the state dict alone
        return (
            f"{path} holds {weights[0]} but no config.json (a state dict alone, as DeepSpeed's "
            f"zero_to_fp32.py writes); copy the config.json of the model it was trained as there"
        )
    return f"{path}: no config.json; expected a transformers directory written by save_pretrained"


MEGAPAR_PARTS = ("moe_router_score", "shared_expert_intermediate_size", "moe_bias_update_rate")
"""Model settings of megapar's own that change what a MoE computes (a sigmoid router, shared
experts, a routing bias): no transformers Mixtral / Qwen3-MoE reads them."""


def _refuse_megapar_parts(raw: dict, where) -> None:
    """Refuse a transformers config.json that sets `MEGAPAR_PARTS`: transformers loads the
    directory without them, so megapar would build another model than the directory's."""
    given = [k for k in MEGAPAR_PARTS if raw.get(k) not in (None, 0, 0.0, "softmax")]
    if given:
        raise ConfigError(
            f"{where} sets {', '.join(f'{k}={raw[k]!r}' for k in given)}: megapar's own "
            f"settings, which transformers ignores, so megapar would build another model than "
            f"this directory's; remove them from config.json (a megapar --model config takes "
            f"them)"
        )


def _refuse_other_model(raw: dict, path: Path) -> None:
    """Refuse a transformers directory of a model type megapar does not build, naming its
    architecture and the ones megapar trains."""
    kind = raw.get("model_type")
    if kind in ARCHITECTURES:
        return
    names = raw.get("architectures")
    name = ", ".join(map(str, names)) if isinstance(names, list) and names else "its model"
    known = {v: k for k, v in ARCHITECTURES.items()}
    if name in known:  # an architecture megapar builds, its model_type missing or mistyped
        raise ConfigError(
            f'{path}/config.json: {name} with model_type {kind!r}; set "model_type": '
            f'"{known[name]}" (transformers writes it so)'
        )
    raise ConfigError(
        f"{path}: {name} (model_type {kind!r}) is not a model megapar builds; it trains "
        f"{' / '.join(ARCHITECTURES.values())} checkpoints"
    )


class HFReader:
    """Lazy access to the tensors of a local transformers directory (no network)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        cfg = self.path / "config.json"
        if is_address(str(path)) and not cfg.exists():  # Path(hf://gpt2) drops a /
            raise FileNotFoundError(address_line(str(path), "DIR"))
        if not cfg.exists():
            raise FileNotFoundError(_not_transformers(self.path))
        raw = load_config_file(cfg)
        if not raw:  # (it was "its model (model_type None) is not a model megapar builds")
            raise ConfigError(
                f"{cfg} is empty: a transformers model's config.json holds its settings; copy "
                f"the model directory again (or save it again with save_pretrained)"
            )
        _refuse_megapar_parts(raw, cfg)
        _refuse_other_model(raw, self.path)
        try:
            self.config = config_from_dict(raw)
        except ConfigError as exc:
            raise ConfigError(f"{cfg}: {exc}") from None
        self._saved_dtype = raw.get("dtype") or raw.get("torch_dtype")
        st, pt = self.path / "model.safetensors", self.path / "pytorch_model.bin"
        if st.exists():
            self._file = _open(st)
            self.keys = set(self._file.keys())
            self._get = self._file.get_tensor
            self._shape = lambda key: self._file.get_slice(key).get_shape()
        elif (self.path / "model.safetensors.index.json").exists():  # sharded (Llama 8B, 70B)
            index_file = self.path / "model.safetensors.index.json"
            weight_map = load_config_file(index_file).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:  # (a KeyError traceback)
                what = "no weight_map" if weight_map is None else "its weight_map is no mapping"
                raise ConfigError(
                    f"{index_file} maps no tensor to its shards ({what}): copy the "
                    f"model directory again (or save it again with save_pretrained)"
                )
            odd = next((k for k, v in weight_map.items() if not isinstance(v, str) or not v), None)
            if odd is not None:  # a file name that is a number: a TypeError traceback
                raise ConfigError(
                    f"{index_file} maps {odd} to {weight_map[odd]!r}, no shard's file name: the "
                    f"index is damaged; copy the model directory again (or save it again with "
                    f"save_pretrained)"
                )
            opened: dict[str, object] = {}
            held: dict[str, set[str]] = {}  # each shard's tensor names

            def shard(key: str):
                fname = weight_map[key]
                if fname not in opened:
                    handle = opened[fname] = _open(self.path / fname)
                    held[fname] = set(handle.keys())
                if key not in held[fname]:  # a damaged index (safetensors: a traceback)
                    raise ConfigError(
                        f"{self.path / 'model.safetensors.index.json'} maps {key} to {fname}, "
                        f"which does not hold it: the index does not match its shards; copy the "
                        f"model directory again (or save it again with save_pretrained)"
                    )
                return opened[fname]

            self.keys = set(weight_map)
            self._get = lambda key: shard(key).get_tensor(key)
            self._shape = lambda key: shard(key).get_slice(key).get_shape()
        elif pt.exists():
            state = _load_pickled_weights(pt)
            self.keys = set(state)
            self._get = state.__getitem__
            self._shape = lambda key: state[key].shape
        else:
            raise FileNotFoundError(
                f"{self.path}: neither model.safetensors (or its sharded "
                f"index) nor pytorch_model.bin found; give the directory save_pretrained wrote "
                f"the weights into (a config alone has none)"
            )
        self.prefix = self._detect_prefix()
        self._untie_a_distinct_head()
        self._expected: dict[str, tuple[int, ...]] | None = None
        self._meta: dict[str, torch.Tensor] | None = None
        self._generation_file: Path | None = self.path / "generation_config.json"
        # an in-memory model's (`from_model`); without the file, config.json's list of eos ids
        # (the model's config keeps the first), as transformers' from_model_config takes them
        listed = any(isinstance(raw.get(k), list) for k in ("bos_token_id", "eos_token_id"))
        self._generation: dict | None = (
            {
                k: raw[k]
                for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                if raw.get(k) is not None
            }
            if listed
            else None
        )

    @classmethod
    def from_model(cls, hf_model) -> HFReader:
        """Read an in-memory transformers model (GPT2LMHeadModel, BertForMaskedLM, ...)."""

        self = cls.__new__(cls)
        self.path = Path(f"<{type(hf_model).__name__}>")
        self.config = config_from_hf(hf_model.config)
        state = hf_model.state_dict()
        self.keys = set(state)
        self._get = lambda k: state[k].detach().cpu()
        self._shape = lambda k: state[k].shape
        self._saved_dtype = None
        self.prefix = self._detect_prefix()
        self._untie_a_distinct_head()
        self._expected = None
        self._meta = None
        self._generation_file = None  # an in-memory model: no files, its generation_config
        generation = getattr(hf_model, "generation_config", None)  # as save_pretrained writes it
        self._generation = (
            json.loads(generation.to_json_string()) if generation is not None else None
        )
        return self

    @property
    def generation_config(self) -> dict | None:
        """The directory's ``generation_config.json`` (as a dict; an in-memory model's
        ``generation_config`` as ``save_pretrained`` would write it), None when it has none. An
        import (and `megapar.prepare`) records it, so that the export writes it back."""
        return self._read_generation_config()

    def _read_generation_config(self) -> dict | None:
        path = self._generation_file
        if path is None or not path.is_file():
            return self._generation
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ConfigError(
                f"{path}: not a readable JSON file ({exc}); fix or remove it (an "
                f"export then writes one from the model's config)"
            ) from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: not a JSON object; fix or remove it")
        return data

    @property
    def dtype(self) -> str:
        """The dtype of the weights ("bfloat16", "float32", ...): config.json's ``dtype`` (or
        ``torch_dtype``), else the word embedding's. An export writes this dtype by default."""
        if isinstance(self._saved_dtype, str) and self._saved_dtype != "auto":
            return self._saved_dtype.removeprefix("torch.")
        probe = _embedding(self.config)
        return str(self.get(probe).dtype).removeprefix("torch.")

    def _detect_prefix(self) -> str:
        probe = _embedding(self.config)
        for prefix in ("transformer.", "bert.", "model.", ""):
            if prefix + probe in self.keys:
                return prefix
        raise ConfigError(
            f"{self.path}: not a {self.config.model_type} checkpoint (no {probe} found)"
        )

    def _untie_a_distinct_head(self) -> None:
        """A model of Llama's layout (Llama, Qwen3, Qwen2, Mistral, Mixtral, Qwen3-MoE) whose
        config.json ties the head to the embedding
        (``tie_word_embeddings: true``) while its weights hold an ``lm_head.weight`` of other
        values is read untied, with the weights' head: what transformers (5) does, which then
        warns that the config should say ``tie_word_embeddings=False``. An ``lm_head.weight``
        equal to the embedding (a ``pytorch_model.bin`` holds both) stays tied."""
        config = self.config
        if config.model_type not in LLAMA_TYPES:
            return
        if not config.tie_word_embeddings or "lm_head.weight" not in self.keys:
            return
        if self._equals_embedding("lm_head.weight"):
            return
        self.config = config_from_dict({**config.to_dict(), "tie_word_embeddings": False})

    def unused_keys(self) -> list[str]:
        """The tensors of the weights files that the model the config describes does not read
        (sorted), less those transformers ignores too (`TOLERATED`, the tied head). Reads the
        files' headers only."""
        fn = CANONICAL[self.config.model_type]
        used: set[str] = set()

        def probe(reads: set[str]):
            def get(key: str) -> torch.Tensor:
                k = self._key(key)
                shape = tuple(self._shape(k))
                self._check_shape(key, shape)
                reads.add(k)
                return torch.empty(shape, device="meta")

            return get

        for name in self._meta_params():
            reads: set[str] = set()
            try:
                fn(name, probe(reads), self.config)
            except KeyError:
                continue  # not in the files: initialised instead (a BertModel's head)
            used |= reads
        tolerated = TOLERATED.get(self.config.model_type, ())
        head = TIED_HEAD[self.config.model_type] + ".weight"
        if head in self.keys and self._tied_copy(head):
            used.add(head)
        pattern = re.compile("|".join(f"(?:{t})" for t in (*TOLERATED_ALL, *tolerated)))
        return sorted(k for k in self.keys - used if not pattern.search(k))

    def _tied_copy(self, head: str) -> bool:
        """Whether the files' head `head` is a copy of the word embedding in a model that ties
        them (GPT-2 and BERT always do): what a ``pytorch_model.bin`` holds."""
        return getattr(self.config, "tie_word_embeddings", True) and self._equals_embedding(head)

    def _equals_embedding(self, key: str) -> bool:
        """Whether the files' tensor `key` holds the word embedding's values (a tied head's
        copy)."""
        tensor, embedding = self._get(key), self._get(self._key(_embedding(self.config)))
        return tensor.shape == embedding.shape and bool(torch.equal(tensor, embedding))

    def _refuse_unused(self) -> None:
        """ConfigError naming the tensors of the files the config does not use (the first few,
        how many) and the config field to fix: loading would drop them silently (and initialise
        what the config expects in their place)."""
        unused = self.unused_keys()
        if not unused:
            return
        head = TIED_HEAD[self.config.model_type] + ".weight"
        if unused == [head]:  # a GPT-2's or BERT's (a Llama's is read untied)
            raise ConfigError(
                f"{self.path}: {head} holds other values than the word embedding, which "
                f"megapar's {self.config.model_type} ties the head to (transformers would "
                f"use it untied); megapar cannot train this model untied: tie them (set the "
                f"head to the embedding and save the model again)"
            )
        shown = ", ".join(unused[:3]) + (f" (and {len(unused) - 3} more)" if unused[3:] else "")
        raise ConfigError(
            f"{self.path}: the weights hold {len(unused)} tensor(s) the model its config.json "
            f"describes does not use: {shown}; megapar would drop them (and initialise what the "
            f"config expects instead): make config.json's {_fields_to_fix(unused, self.config)} "
            f"describe the weights"
        )

    def _key(self, key: str) -> str:
        for k in (self.prefix + key, key):
            if k in self.keys:
                return k
        raise KeyError(key)

    def _check_shape(self, key: str, shape) -> None:
        """ConfigError unless the tensor `key` (a name as `get` takes it) has the shape the
        config implies."""
        if self._expected is None:
            self._expected = expected_hf_shapes(self.config, self._meta_params())
        want = self._expected.get(key)
        if want is not None and tuple(shape) != want:
            raise ConfigError(
                f"{self.path}: {self._key(key)} has shape {list(shape)}, its "
                f"config.json implies {list(want)}; the weights do not belong to "
                f"this config (a damaged or forged file?): restore it, or save "
                f"the model again with save_pretrained"
            )

    def _meta_params(self) -> dict[str, torch.Tensor]:
        """The config's model's canonical parameters on the meta device (`_meta_parameters`),
        built once for this reader's checks."""
        if self._meta is None:
            self._meta = _meta_parameters(self.config)
        return self._meta

    def check_files(self) -> None:
        """Check what a conversion reads before it reads it (ConfigError naming the first
        problem): that the config uses every tensor of the files (`unused_keys`), that the
        files hold every tensor of the blocks the config implies, every tensor's shape against
        the config (from the files' headers: nothing is loaded from safetensors) and
        generation_config.json."""
        self._read_generation_config()
        if self._expected is None:
            self._expected = expected_hf_shapes(self.config, self._meta_params())
        lacking = []
        for key in self._expected:
            try:
                shape = self._shape(self._key(key))
            except KeyError:
                lacking.append(key)  # a block's: refused; else (BertModel's head) initialised
                continue
            self._check_shape(key, shape)
        self._refuse_unused()  # first: it names the config's fields to fix, where it can
        self._refuse_lacking_blocks(lacking)

    def _refuse_lacking_blocks(self, lacking: list[str]) -> None:
        """ConfigError if the files lack a tensor of a block the config implies: config.json
        then describes other weights (another layer count or block), which an import would
        fill with freshly initialised layers."""
        blocks = [k for k in lacking if BLOCK_KEY.search(k)]
        if not blocks:
            return
        held = sorted({int(m.group(2)) for k in self.keys if (m := BLOCK_KEY.search(k))})
        holds = f"layers {held[0]}-{held[-1]}" if held else "no layer"
        raise ConfigError(
            f"{self.path}: config.json implies {self.config.num_layers} layers, but the weights "
            f"hold {holds} and lack {len(blocks)} tensor(s) of the blocks ({blocks[0]}, ...); "
            f"config.json does not describe these weights: correct it (its layer count?), or "
            f"save the model again with save_pretrained"
        )

    def get(self, key: str) -> torch.Tensor:
        """An HF tensor by its name (without the model prefix for base-model tensors), checked
        to have the shape the config implies."""
        tensor = self._get(self._key(key))
        self._check_shape(key, tensor.shape)
        return tensor

    def canonical(self, name: str) -> torch.Tensor:
        """The full canonical tensor `name`, converted from the HF tensors."""
        fn = CANONICAL[self.config.model_type]
        return fn(name, self.get, self.config).contiguous()


BLOCK_KEY = re.compile(r"(^|\.)(?:h|layers|layer)\.(\d+)\.")
"""A transformers tensor name of a block's tensor (GPT-2's h.N., BERT's encoder.layer.N.,
Llama's and the MoE models' layers.N.); group 2 is the block's index."""

TOLERATED_ALL = (r"(^|\.)rotary_emb\.inv_freq$", r"(^|\.)position_ids$")
"""Buffers older transformers saved and transformers ignores on loading (regular expressions
searched in the files' names): rotary frequencies, position ids."""
TOLERATED = {
    "gpt2": (r"\.(attn|crossattention)\.(masked_)?bias$",),
    "bert": (
        r"^(bert\.)?pooler\.",
        r"^cls\.seq_relationship\.",
        r"^cls\.predictions\.decoder\.bias$",
    ),
    "deepseek_v3": (r"^(model\.)?layers\.61\.",),
}
"""Per model type, the other tensors a file may hold that transformers' class ignores too:
GPT-2's causal-mask buffers; BERT's pooler and next-sentence head (of BertModel /
BertForPreTraining checkpoints) and the decoder's bias (tied to ``cls.predictions.bias``);
DeepSeek-V3's multi-token prediction layer 61 (transformers' _keys_to_ignore_on_load_unexpected:
neither builds it)."""


def _fields_to_fix(unused: list[str], config) -> str:
    """The config.json fields that most likely describe the `unused` tensors otherwise."""
    kind = config.model_type
    layers = {int(m.group(1)) for k in unused if (m := _LAYER_OF.search(k))}
    depth = {"gpt2": "n_layer"}.get(kind, "num_hidden_layers")
    if layers and max(layers) >= getattr(config, depth):
        return depth
    if kind == "qwen3_moe" and layers:
        return "decoder_sparse_step / mlp_only_layers (and num_experts)"
    if kind == "mixtral" and any(".experts." in k for k in unused):
        return "num_local_experts"
    return "model_type and sizes"


_LAYER_OF = re.compile(r"(?:layers|h|layer)\.(\d+)\.")


def _embedding(config) -> str:
    """The word embedding's transformers name, without the base model's prefix."""
    return {"gpt2": "wte.weight", "bert": "embeddings.word_embeddings.weight"}.get(
        config.model_type, "embed_tokens.weight"
    )


def _meta_parameters(config) -> dict[str, torch.Tensor]:
    """megapar's canonical parameters of the model `config` describes, by name, built on the
    meta device (tied copies not: they read their source), and the buffers its transformers
    class holds too (DeepSeek-V3's router bias, `DEEPSEEK_ROUTER_TYPES`)."""
    stage = build_stage(config, Mesh.virtual(Layout(1, 1, 1)), seed=0, init=False)
    out: dict[str, torch.Tensor] = {
        n: p for n, p in stage.named_parameters() if not hasattr(p, "tied_to")
    }
    if config.model_type in DEEPSEEK_ROUTER_TYPES:
        out.update((n, b) for n, b in stage.named_buffers() if n.endswith(".router.bias"))
    return out


def expected_hf_shapes(config, params=None) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor of the transformers model `config` describes, by the name
    `HFReader.get` takes (without the base model's prefix): megapar's parameters (`params`, the
    config's `_meta_parameters` where not given), mapped as an export maps them."""
    params = _meta_parameters(config) if params is None else params
    canonical = {
        name: torch.empty(getattr(p, "full_shape", p.shape), device="meta")
        for name, p in params.items()
    }
    shapes = {}
    for name, tensor in TO_HF[config.model_type](canonical, config).items():
        for prefix in HF_PREFIXES:
            name = name.removeprefix(prefix)
        shapes[name] = tuple(tensor.shape)
    return shapes


# --- megapar models <-> HF -----------------------------------------------------------------
@torch.no_grad()
def load_hf_weights(model: torch.nn.Module, reader: HFReader) -> list[str]:
    """Copy this rank's shard of every parameter from an HF checkpoint into `model` (of a
    routed expert's stacked weights under ep, this ep rank's experts: `ep_shard`).

    Returns the canonical names the checkpoint lacks (e.g. the MLM head of a plain BertModel);
    those parameters keep the values they had (call `model.init_weights(seed)` first).
    """
    missing = []
    mesh: Mesh = model.mesh  # type: ignore[assignment]  # set on megapar's stages
    tp_rank = mesh.tp_rank
    for name, param in model.named_parameters():
        source = getattr(param, "tied_to", name)
        try:
            full = reader.canonical(source)
        except KeyError:
            missing.append(source)
            continue
        ep_rank, ep = getattr(param, "ep_shard", (0, 1))
        if ep > 1 and full.shape[0] == param.shape[0] * ep:  # this ep rank's experts
            full = full.narrow(0, ep_rank * param.shape[0], param.shape[0])
        dim = getattr(param, "tp_dim", None)
        if tuple(full.shape) != tuple(getattr(param, "full_shape", param.shape)):
            raise ConfigError(
                f"{reader.path}: {source} has shape {tuple(full.shape)}, the model "
                f"expects {param.full_shape}"  # type: ignore[attr-defined]  # tp-sharded ones'
            )
        local = param.shape[dim] if dim is not None else None
        param.copy_(shard_of(full.to(param.dtype), dim, local, tp_rank, tp_parts(param)))
    for name, buffer in model.named_buffers():
        if name.endswith(".router.bias"):  # DeepSeek-V3's e_score_correction_bias
            try:
                buffer.copy_(reader.canonical(name))
            except KeyError:  # a model whose files have none (megapar's own balancing bias)
                pass
    return missing


def to_hf_state(canonical: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """transformers' state dict (the names of the model's class in `hf_names.ARCHITECTURES`)
    from canonical tensors."""
    fn = TO_HF[config.model_type]
    return {k: v.contiguous() for k, v in fn(canonical, config).items()}


def causal_rows(tokenizer) -> int:
    """The token ids a causal LM trained with megapar's `tokenizer` can see: its base
    vocabulary and its end of document (the [PAD] [CLS] [SEP] [MASK] megapar appends after them
    are BERT's, never in a causal LM's data)."""
    return max(tokenizer.base_vocab_size, tokenizer.eod_id + 1)


def model_rows(tokenizer, model_type: str) -> int:
    """The token ids a model of `model_type` trained with megapar's `tokenizer` can see, which
    its vocabulary must hold: a causal LM's `causal_rows`, BERT's every id."""
    return causal_rows(tokenizer) if model_type in CAUSAL_LM_TYPES else tokenizer.vocab_size


def cut_to_tokenizer(canonical: dict[str, torch.Tensor], config, tokenizer):
    """(canonical, config) of a causal LM cut to the rows of its tokenizer (`causal_rows`): a
    GPT-2 trained on the GPT-2 BPE to 50,257 rows, as Hugging Face's GPT-2 has, not the 50,261
    of megapar's vocabulary, whose 4 appended rows its data never holds. Its logits on the
    tokenizer's ids are unchanged, its probabilities are not quite: the softmax it trained
    with spans every row. Unchanged for BERT, for no tokenizer, or when the model has no rows
    to spare."""
    if tokenizer is None or config.model_type not in CAUSAL_LM_TYPES:
        return canonical, config
    rows = causal_rows(tokenizer)
    if rows >= config.vocab_size:
        return canonical, config
    cut = dict(canonical)
    for name in ("embed.word.weight", "head.weight"):
        if name in cut:
            cut[name] = cut[name][:rows]
    return cut, config_from_dict({**config.to_dict(), "vocab_size": rows})


HF_FILES = ("model.safetensors", "config.json")
"""The files an export writes (and replaces); anything else in the directory is left alone."""
GENERATION_FILE = "generation_config.json"
"""What a causal LM's export writes besides `HF_FILES` (and replaces)."""
OTHER_WEIGHTS = re.compile(
    r"model\.safetensors\.index\.json|model-\d+-of-\d+\.safetensors"
    r"|pytorch_model(-\d+-of-\d+)?\.bin(\.index\.json)?"
)
"""Weights files of another save into the directory (`save_pretrained`'s shards and index, a
``pytorch_model.bin``), which an export removes: a stale index beside the new
``model.safetensors`` sends loaders that read the index first (vLLM) to the old weights."""


def other_weights(out_dir: Path) -> list[str]:
    """The names of `OTHER_WEIGHTS` files in `out_dir`, sorted."""
    names = os.listdir(out_dir) if out_dir.is_dir() else []
    return sorted(n for n in names if OTHER_WEIGHTS.fullmatch(n))


TOKENIZER_STAGE = ".tokenizer.export-"
"""The prefix of the directory an export writes its tokenizer's files into until the end."""

REPLACED_STAGE = ".replaced.export-"
"""The prefix of the directory an export moves the files it replaces into until it is
complete: put back where it fails, removed where it succeeds, put back by the next export
where it was killed (`recover_stopped_export`)."""

PLACING = ".placing"
"""The file in a `REPLACED_STAGE` directory that names, a line each, the files the export puts
in place, written once every file it replaces is moved aside: an export killed after it had
begun to put them in place left those (`recover_stopped_export`)."""


EXPORT_STAGES = (TOKENIZER_STAGE, TOKENIZER_TMP, REPLACED_STAGE)
"""The prefixes of an export's staging directories (named with `owner_tag`)."""


def recover_stopped_export(out_dir: str | Path) -> str | None:
    """Undo what an export killed -9 among its final renames (`save_hf`) left in `out_dir`,
    where it has no config.json (the export puts it in place last, and this puts it back last):
    the files that export had put in place (`PLACING`) are removed and the files of the model
    it was replacing, moved aside into ``.replaced.export-PID-HOST-`` by a process of this host
    that is gone, are put back, config.json last, so the directory holds that model again, or
    nothing of the export's where it replaced nothing. A kill during this is undone by the next
    call. Its other temporaries (the weights' size) are removed. Returns a note saying what it
    did, else None."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return None
    prefixes = (*(f".{n}.tmp-" for n in (*HF_FILES, GENERATION_FILE)), *EXPORT_STAGES)
    _refuse_another_export(out_dir, prefixes)
    notes = []
    if not (out_dir / "config.json").exists():
        for name in stale_temporaries(out_dir, REPLACED_STAGE):
            stash = out_dir / name
            if not stash.is_dir() or stash.is_symlink():
                continue
            placing = stash / PLACING
            if placing.exists():  # its own files first (none of them is the replaced model's)
                placed = [n for n in placing.read_text().split("\n") if (out_dir / n).is_file()]
                for n in placed:
                    (out_dir / n).unlink()
                placing.unlink()
                if placed:
                    notes.append(f"the {counted(len(placed), 'file')} it had put in place removed")
            files = sorted(os.listdir(stash), key=lambda n: n == "config.json")  # config last
            for n in files:
                os.replace(stash / n, out_dir / n)
            shutil.rmtree(stash, ignore_errors=True)
            if files:
                notes.append(
                    f"the model it was replacing put back ({counted(len(files), 'file')} from "
                    f"{name})"
                )
    for prefix in prefixes:
        remove_stale_temporaries(out_dir, prefix)  # of an export killed -9 (its weights' size)
    return f"{out_dir}: an export killed midway: " + "; ".join(notes) if notes else None


def _refuse_another_export(out_dir: Path, prefixes: tuple[str, ...]) -> None:
    """Raise `CheckpointError` where `out_dir` holds another export's temporaries or staging
    directories that are not a dead process's of this host (`stale_temporaries`): a live
    export's, or another host's, which may be either. Writing beside it would mix the two
    exports' files, and another host's moved-aside model would be lost when it completes."""
    names = os.listdir(out_dir)
    mine = f"-{owner_tag()}-"  # this process's own (an export of it earlier, failed)
    for prefix in prefixes:
        stale = set(stale_temporaries(out_dir, prefix))
        other = sorted(
            n for n in names if n.startswith(prefix) and n not in stale and mine not in n
        )
        if other:
            what = "what it moved aside" if prefix == REPLACED_STAGE else "a temporary of it"
            raise CheckpointError(
                f"{out_dir}: another export into it is running, or was killed on another host "
                f"({other[0]}: {what}); wait for it to finish, or export elsewhere; where none "
                f"runs, move {other[0]} out of {out_dir}"
            )


def save_hf(
    canonical: dict[str, torch.Tensor],
    config,
    out_dir: str | Path,
    tokenizer=None,
    dtype: torch.dtype | None = None,
    generation_config: dict | None = None,
    tokenizer_rows: bool = False,
) -> Path:
    """Write config.json + model.safetensors into `out_dir` (created if missing), which
    transformers' `from_pretrained` loads, and, given a megapar `tokenizer`, that tokenizer in
    transformers' format (`save_for_transformers`: checked to encode as megapar does; its
    ``model_max_length`` the model's positions), so `AutoTokenizer.from_pretrained(out_dir)`
    works too; the config's special ids (``pad_token_id``, ``bos_token_id``, ...) are then the
    tokenizer's (transformers builds BERT's embedding with ``padding_idx=pad_token_id``). A
    causal LM (GPT-2, Llama, Mixtral, Qwen3-MoE) gets a ``generation_config.json`` too:
    `generation_config` (the one of the transformers model it was imported from), else transformers'
    ``GenerationConfig.from_model_config`` of the config written. `dtype`: the weights' dtype
    in the files (default: as given), recorded as the config's ``dtype``. `tokenizer_rows`: a
    causal LM's embedding (and head) cut to its tokenizer's ids (`cut_to_tokenizer`). As
    `save_pretrained`,
    the weights files of another save there are removed (`OTHER_WEIGHTS`; an encoder's export
    also a causal LM's ``generation_config.json``), other files (notes)
    are left alone; each file is written under a temporary name and
    renamed when all are complete (the tokenizer, then the rest, config.json last), the files it
    replaces moved aside first (`REPLACED_STAGE`, config.json first), so a failed export leaves
    no file of its own (nor the directory, when it made it) and puts back those it replaced (or
    says where they are), and one killed -9 midway leaves no config.json, which loaders refuse,
    rather than two models' files; the next export into the directory undoes what one killed
    -9 left (`recover_stopped_export`: the model it was replacing put back, its temporaries,
    named with `owner_tag`, removed)."""

    from transformers import GenerationConfig

    out_dir = Path(out_dir)
    top = out_dir
    while not top.parent.exists():
        top = top.parent
    created = None if out_dir.exists() else top  # the outermost directory this export makes
    out_dir.mkdir(parents=True, exist_ok=True)
    if tokenizer_rows:
        canonical, config = cut_to_tokenizer(canonical, config, tokenizer)
    if dtype is not None:
        canonical = {k: v.to(dtype) for k, v in canonical.items()}
    causal = config.model_type in CAUSAL_LM_TYPES
    names = HF_FILES + ((GENERATION_FILE,) if causal else ())
    note = recover_stopped_export(out_dir)  # one killed among its renames, or its temporaries
    if note is not None:
        print(f"note: {note}", file=sys.stderr)
    tmp = {name: out_dir / f".{name}.tmp-{owner_tag()}-" for name in names}
    stage = out_dir / f"{TOKENIZER_STAGE}{owner_tag()}-"  # the tokenizer's files, until the end
    replaced = out_dir / f"{REPLACED_STAGE}{owner_tag()}-"  # what it replaces, until the end
    placed: list[Path] = []  # the files this export has put in place
    try:
        special_ids: dict[str, int | None] = {}
        if tokenizer is not None:
            save_for_transformers(
                tokenizer,
                str(stage),
                config.vocab_size,
                sentence_pairs=config.model_type == "bert",
                model_max_length=config.max_positions,
                info=special_ids,
            )
        hf_config = _export_config(config, canonical, special_ids)
        if causal:
            text = (
                json.dumps(generation_config, indent=2, sort_keys=True) + "\n"
                if generation_config is not None
                else GenerationConfig.from_model_config(hf_config).to_json_string()
            )
            tmp[GENERATION_FILE].write_text(text)
        save_file(
            to_hf_state(canonical, config), str(tmp["model.safetensors"]), metadata={"format": "pt"}
        )
        give_usual_mode(tmp["model.safetensors"])  # safetensors creates it 0600
        tmp["config.json"].write_text(_config_json(hf_config, config))
        tokenizer_files = sorted(os.listdir(stage)) if stage.is_dir() else []
        moves = [(stage / n, out_dir / n) for n in tokenizer_files]
        moves += [(tmp[n], out_dir / n) for n in names if n != "config.json"]
        moves.append((tmp["config.json"], out_dir / "config.json"))  # last: what loaders read
        replaced.mkdir()
        # what it replaces is moved aside first, config.json first of all, and config.json is
        # put in place last: a directory this export stops in midway (killed -9) has no
        # config.json, which transformers refuses to load, rather than a mix of two models
        aside = ["config.json", *other_weights(out_dir), *(t.name for _, t in moves)]
        if not causal:  # a causal LM's export it replaces: its generation config goes too
            aside.append(GENERATION_FILE)
        for name in dict.fromkeys(aside):
            if os.path.lexists(out_dir / name):
                os.replace(out_dir / name, replaced / name)
        (replaced / PLACING).write_text("".join(f"{t.name}\n" for _, t in moves))
        for source, target in moves:
            os.replace(source, target)
            placed.append(target)
        shutil.rmtree(replaced, ignore_errors=True)  # complete: what it replaced goes
    except BaseException as exc:
        for path in (*tmp.values(), *placed):
            path.unlink(missing_ok=True)
        stranded = []
        (replaced / PLACING).unlink(missing_ok=True)
        for name in os.listdir(replaced) if replaced.is_dir() else ():
            try:
                os.replace(replaced / name, out_dir / name)  # put back what it replaced
            except OSError:
                stranded.append(name)
        if created is not None:  # the directories are this export's: none is left
            shutil.rmtree(created, ignore_errors=True)
        if stranded:
            raise CheckpointError(
                f"{type(exc).__name__}: {exc}; and the files it replaced could not all be put "
                f"back: {', '.join(stranded)} are in {replaced}"
            ) from exc
        shutil.rmtree(replaced, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return out_dir


def _config_json(hf_config, config) -> str:
    """The exported config.json: `hf_config`'s JSON, and for a Qwen3-MoE its routed experts
    under the hub's key `num_experts` too (transformers 5 writes `num_local_experts` only, which
    transformers 4's Qwen3MoeConfig does not read: it would build its default 128 experts)."""
    text = hf_config.to_json_string()
    if config.model_type != "qwen3_moe":
        return text
    raw = json.loads(text)
    raw["num_experts"] = config.num_local_experts
    return json.dumps(raw, indent=2, sort_keys=True) + "\n"


def _export_config(config, canonical: dict[str, torch.Tensor], special_ids: dict):
    """The transformers config an export writes: `config`'s, with the weights' dtype, the
    architecture, the tying, and the special token ids `special_ids` (the exported tokenizer's;
    an id outside the vocabulary is None)."""
    hf_config = config.to_hf()
    hf_config.dtype = str(next(iter(canonical.values())).dtype).removeprefix("torch.")
    hf_config.architectures = [ARCHITECTURES[config.model_type]]
    hf_config.tie_word_embeddings = getattr(config, "tie_word_embeddings", True)
    for special in (f"{role}_token_id" for role in SPECIAL_ROLES):
        if not hasattr(hf_config, special):
            continue
        value = (
            special_ids[special] if special in special_ids else getattr(hf_config, special)
        )  # the tokenizer's ids, when it is exported
        if isinstance(value, int) and value >= config.vocab_size:
            value = None  # GPT-2's 50256 means nothing in another vocabulary
        setattr(hf_config, special, value)
    return hf_config
