"""torchtitan's Llama checkpoints (torch.distributed.checkpoint, "DCP") in and out of megapar.

A torchtitan checkpoint is a DCP directory: ``.metadata`` (the index) and ``__R_S.distcp`` data
files. Its model weights carry torchtitan's Llama 3 names (``tok_embeddings.weight``,
``layers.N.attention.wq.weight``, ``layers.N.attention_norm.weight``,
``layers.N.feed_forward.w1.weight``, ``layers.N.ffn_norm.weight``, ``norm.weight``,
``output.weight``), at the top level of the state dict (or under ``model.``, older torchtitan);
the spelling of torchtitan after its fused-QKV change (``attention.qkv_linear.wq.weight``,
``lm_head.weight``) is read too.

torchtitan's attention applies rotary positions to interleaved pairs (Meta's complex layout),
transformers' (and megapar's) to the two halves of each head (``rotate_half``). So wq and wk
are permuted per head on the way in and back on the way out, exactly as torchtitan's own
Hugging Face adapter does (torchtitan ``torchtitan/models/llama3/model/state_dict_adapter.py``,
``Llama3StateDictAdapter._permute`` / ``_reverse_permute``); every other tensor is an
``nn.Linear`` / norm weight in the same layout under another name.

Only model weights move: torchtitan's optimizer state is keyed by its version's flattening of
``torch.optim`` state (``optimizer.state.<fqn>.exp_avg``, ...) and its step counts and
hyper-parameters live in pickled byte entries, so an import starts at step 0 without optimizer
state (as ``--from-hf`` does) and an export holds the weights only.

DCP's ``.metadata`` is a pickle: it is read here with an unpickler that builds only DCP's
metadata classes, torch sizes and dtypes (anything else is refused); the data files are read
by torch with ``weights_only``.
"""

from __future__ import annotations

import pickle
import re
import shutil
import tomllib
import warnings
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed.checkpoint as dist_cp
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from megapar.checkpoint.convert import (
    _refuse_existing,
    _swap_into,
    check_output,
    output_dir,
    plan,
    write_weights,
)
from megapar.checkpoint.format import (
    CheckpointError,
    ShardReader,
    staging_dir,
)
from megapar.checkpoint.manifest import verify
from megapar.checkpoint.publish import resolve_checkpoint, titan_steps
from megapar.faults.processes import owner_tag, remove_stale_temporaries
from megapar.mesh import Layout
from megapar.models.config import ConfigError, LlamaConfig, config_from_dict
from megapar.models.recipes import resolve_model
from megapar.one_line_parser import shell_word
from megapar.wording import first_few

METADATA = ".metadata"
"""The index file of a DCP checkpoint."""

_TOP = {
    "embed.word.weight": "tok_embeddings.weight",
    "final_norm.weight": "norm.weight",
    "head.weight": "output.weight",
}
_LAYER = {
    "attn_norm": "attention_norm",
    "mlp_norm": "ffn_norm",
    "attn.q": "attention.wq",
    "attn.k": "attention.wk",
    "attn.v": "attention.wv",
    "attn.proj": "attention.wo",
    "mlp.gate": "feed_forward.w1",
    "mlp.up": "feed_forward.w3",
    "mlp.down": "feed_forward.w2",
}
_NEWER = {
    "attention.wq": "attention.qkv_linear.wq",
    "attention.wk": "attention.qkv_linear.wk",
    "attention.wv": "attention.qkv_linear.wv",
    "output.weight": "lm_head.weight",
}
_MEGAPAR_LAYER = re.compile(r"layers\.(\d+)\.(.+)\.weight")

_DEBUG = {"dim": 256, "n_layers": 6, "n_heads": 16, "rope_theta": 500000}
_8B = {
    "dim": 4096,
    "n_layers": 32,
    "n_heads": 32,
    "n_kv_heads": 8,
    "ffn_dim_multiplier": 1.3,
    "multiple_of": 1024,
    "rope_theta": 500000,
}
FLAVORS: dict[str, dict[str, Any]] = {
    # the _flex / _varlen flavors: the same sizes, another attention kernel
    **dict.fromkeys(("debugmodel", "debugmodel_flex_attn", "debugmodel_varlen_attn"), _DEBUG),
    **dict.fromkeys(("8B", "8B_flex", "8B_varlen"), _8B),
    "70B": {
        "dim": 8192,
        "n_layers": 80,
        "n_heads": 64,
        "n_kv_heads": 8,
        "ffn_dim_multiplier": 1.3,
        "multiple_of": 4096,
        "rope_theta": 500000,
    },
    "405B": {
        "dim": 16384,
        "n_layers": 126,
        "n_heads": 128,
        "n_kv_heads": 8,
        "ffn_dim_multiplier": 1.2,
        "multiple_of": 4096,
        "rope_theta": 500000,
    },
}
"""torchtitan's Llama 3 flavors (``llama3_configs``, torchtitan/models/llama3/__init__.py),
the fields a job config's ``[model] flavor`` stands for (defaults: multiple_of 256, norm_eps
1e-5, n_kv_heads = n_heads; the vocabulary follows the tokenizer, so it is read from the
checkpoint's embedding; the RoPE scaling `TITAN_ROPE_SCALING`)."""

TITAN_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
"""The RoPE scaling of every torchtitan Llama 3 flavor since torchtitan's 2025-10-08 change
(#1839, ``RoPEScalingArgs``' defaults: Llama 3.1's), through the last versions that read TOML
job configs: transformers' ``llama3`` rope type. A checkpoint of an earlier torchtitan was
trained without it (`--model` then gives the sizes without ``rope_scaling``)."""
TITAN_ROPE_SAID = (
    "llama3: factor 8, low / high frequency factors 1 / 4, 8,192 original positions, since "
    "torchtitan's 2025-10-08 version"
)
"""`TITAN_ROPE_SCALING` in the words of the notes on it."""


_NOT_WEIGHTS = ("optimizer.", "lr_scheduler", "dataloader", "train_state", "rng")
"""The state a torchtitan checkpoint keeps beside its model's weights (not imported)."""


def titan_name(name: str) -> str:
    """torchtitan's name of megapar's canonical Llama parameter `name`."""
    if name in _TOP:
        return _TOP[name]
    m = _MEGAPAR_LAYER.fullmatch(name)
    assert m is not None  # every other name is a layer's
    i, module = m.groups()
    return f"layers.{i}.{_LAYER[module]}.weight"


def _heads(config) -> tuple[int, int]:
    return config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads


def to_rotate_half(w: torch.Tensor, heads: int) -> torch.Tensor:
    """A torchtitan wq / wk (rotary on interleaved pairs) in transformers' layout (on halves):
    torchtitan's ``Llama3StateDictAdapter._permute``."""
    rows, cols = w.shape
    return w.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def to_interleaved(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of `to_rotate_half`: torchtitan's ``_reverse_permute``."""
    rows, cols = w.shape
    return w.view(heads, 2, rows // heads // 2, cols).transpose(1, 2).reshape(rows, cols)


def intermediate_size(dim: int, multiple_of: int = 256, ffn_dim_multiplier=None) -> int:
    """torchtitan's SwiGLU hidden size (its ``FeedForward``): 2/3 of 4 x dim, scaled, rounded up
    to a multiple of `multiple_of`."""
    hidden = int(2 * 4 * dim / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


# --- reading a DCP directory ---------------------------------------------------------------
class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata classes, torch sizes, dtypes and layouts, paths; nothing else: a
    name is looked up only where it is one of these, never as a dotted path (pickle's protocol
    4 would follow ``os.system`` from a module that imports os)."""

    _ALLOWED: ClassVar[dict[str, set[str]]] = {
        "torch.distributed.checkpoint.metadata": {
            n
            for n, v in vars(dcp_metadata).items()
            if isinstance(v, type) and v.__module__ == dcp_metadata.__name__
        },
        "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
        "torch.serialization": {"_get_layout"},
        "torch": {"Size"},
        "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
        "collections": {"OrderedDict"},
        "builtins": {"set", "frozenset", "slice"},
    }

    def find_class(self, module, name):
        allowed = "." not in name and (
            name in self._ALLOWED.get(module, ())
            or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
        )
        if not allowed:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP's metadata")
        return super().find_class(module, name)


def load_data(out: dict, reader, path, planner=None) -> None:
    """``dist_cp.load(out, ...)`` in one process, a data file that is missing, cut short or
    damaged reported as a CheckpointError naming `path` and the first failure (torch wraps
    each in a CheckpointException whose text is the worker's traceback)."""
    with warnings.catch_warnings():  # "assuming ... a single process": what is meant
        warnings.simplefilter("ignore", UserWarning)
        try:
            dist_cp.load(out, storage_reader=reader, planner=planner, no_dist=True)
        except (Exception, CheckpointException) as exc:  # noqa: BLE001 - one line, its cause
            failures = getattr(exc, "failures", None) or {}
            inner = next(iter(failures.values()), exc)
            inner = inner[0] if isinstance(inner, tuple) else inner
            said = (str(inner).strip().splitlines() or [""])[0].split(". ")[0][:160]
            cause = f"{type(inner).__name__}: {said}" if said else type(inner).__name__
            raise CheckpointError(
                f"{path}: its data files cannot be read ({cause}): the checkpoint is "
                f"incomplete or damaged; copy it again from where it was written"
            ) from None


class _Reader(dist_cp.FileSystemReader):
    """`FileSystemReader` whose ``.metadata`` is read by `unpickler` (`_MetadataUnpickler`), or
    given (`metadata`: the checkpoint's index, read once per checkpoint, not once per tensor)."""

    unpickler: ClassVar[type[pickle.Unpickler]] = _MetadataUnpickler

    def __init__(self, path, metadata=None):
        super().__init__(path)
        self.known = metadata

    def read_metadata(self, *args, **kwargs):
        metadata = self.known if self.known is not None else self._unpickle()
        if getattr(metadata, "storage_meta", None) is not None:
            metadata.storage_meta.load_id = self.load_id
        return metadata

    def _unpickle(self):
        path = Path(self.path) / METADATA
        try:
            with open(path, "rb") as f:
                metadata = self.unpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as exc:
            raise CheckpointError(
                f"{path}: not a DCP index megapar reads ({exc}); refused without running it"
            ) from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(
                f"{path}: not a DCP index megapar reads (it holds a value of type "
                f"{type(metadata).__name__}, not DCP's Metadata)"
            )
        return metadata


def is_dcp(path: str | Path) -> bool:
    """Whether directory `path` holds a DCP checkpoint (its ``.metadata`` or ``*.distcp``)."""
    p = Path(path).expanduser()
    return p.is_dir() and ((p / METADATA).is_file() or any(p.glob("*.distcp")))


class DCPReader:
    """The model weights of a torchtitan Llama DCP checkpoint as megapar's canonical tensors
    (`canonical`), read one tensor at a time; `config` is the Llama they belong to."""

    def __init__(self, path: str | Path, config=None, job_config: str | None = None):
        self.path = Path(path).expanduser()
        if not (self.path / METADATA).is_file():
            steps = titan_steps(self.path) if self.path.is_dir() else []
            what = (
                "has *.distcp files but no .metadata (an interrupted save?)"
                if is_dcp(self.path)
                else f"is torchtitan's checkpoint folder ({', '.join(steps[-3:])}), not one step"
                if steps
                else "is not a DCP checkpoint (no .metadata)"
            )
            step = shell_word(str(Path(path) / steps[-1])) if steps else "checkpoint/step-N"
            raise CheckpointError(f"{path} {what}; give a torchtitan step directory ({step})")
        self.metadata = metadata = _Reader(self.path).read_metadata()
        """The checkpoint's index, read once (every tensor's load is given it)."""
        self.tensors = {
            k: v
            for k, v in metadata.state_dict_metadata.items()
            if isinstance(v, TensorStorageMetadata)
        }
        prefix = next(
            (p for p in ("", "model.") if p + "tok_embeddings.weight" in self.tensors), None
        )
        if prefix is None:
            shown = ", ".join(sorted(self.tensors)[:4]) or "none"
            raise CheckpointError(
                f"{path}: a DCP checkpoint without torchtitan's Llama "
                f"weights (no tok_embeddings.weight; tensors: {shown}); "
                f"megapar-convert --from-dcp reads torchtitan's Llama 3"
            )
        self.prefix = prefix
        self.newer = self.prefix + "layers.0.attention.qkv_linear.wq.weight" in self.tensors
        self.optimizer = any(k.startswith("optimizer.") for k in self.tensors)
        self.spec_vocab: int | None = None
        """--model's vocabulary where it was not the checkpoint's (which the import takes)."""
        self.config = self._config(config, job_config)

    def _key(self, name: str) -> str:
        key = name
        if self.newer:
            for old, new in _NEWER.items():
                key = key.replace(old, new)
        return self.prefix + key

    def shape(self, titan: str) -> list[int] | None:
        entry = self.tensors.get(self._key(titan))
        return None if entry is None else list(entry.size)

    def _config(self, config, job_config):
        """The Llama of the weights: `config` (a megapar model spec), else the job config's
        flavor, with the checkpoint's vocabulary (torchtitan's follows the tokenizer the job
        trained with, not the flavor or recipe; `spec_vocab` keeps the spec's where it
        differed); its layers and sizes checked against the weights' shapes."""
        vocab = self.shape("tok_embeddings.weight")[0]
        if config is None and job_config is None:
            raise ConfigError(
                f"--from-dcp {self.path}: say which Llama this is: --job-config "
                f"TOML (torchtitan's job config, whose [model] flavor names it) "
                f"or --model SPEC (a megapar recipe or config.json)"
            )
        if config is None:
            config = config_from_job(job_config, vocab)
        elif isinstance(config, str):
            config = resolve_model(config)
        if config.model_type != "llama":
            raise ConfigError(
                f"--model is a {config.model_type} model; torchtitan's "
                f"checkpoints hold Llama weights: give a llama config"
            )
        tied = self._tied(config)
        if tied != bool(config.tie_word_embeddings) or vocab != config.vocab_size:
            if vocab != config.vocab_size:
                self.spec_vocab = config.vocab_size
            config = config_from_dict(
                {**config.to_dict(), "tie_word_embeddings": tied, "vocab_size": vocab}
            )
        for name, entry in plan(config, Layout(1, 1, 1)).items():
            got, want = self.shape(titan_name(name)), entry["full_shape"]
            if got != want:
                raise ConfigError(
                    f"{self.path}: {self._key(titan_name(name))} is "
                    f"{'missing' if got is None else got}, the config implies "
                    f"{want}; give the --job-config / --model it was trained with"
                )
        read = {self._key(titan_name(name)) for name in plan(config, Layout(1, 1, 1))}
        read.add(self._key("output.weight"))
        extra = sorted(
            k
            for k in self.tensors
            if k.startswith(self.prefix)
            and k not in read
            and not k.startswith(_NOT_WEIGHTS)
            and not k.endswith("freqs_cis")  # older torchtitan's saved rotary table
        )
        if extra:
            raise ConfigError(
                f"{self.path}: tensors megapar's llama has no place for: "
                f"{first_few(extra, 3)}; refused rather than dropped (give the "
                f"--job-config / --model it was trained with, if megapar's Llama has them)"
            )
        return config

    def _tied(self, config) -> bool:
        """Whether the weights are a tied Llama: no ``output.weight`` (megapar's exports before
        they wrote it), or one equal to ``tok_embeddings.weight`` where `config` ties them
        (torchtitan's ``enable_weight_tying`` saves the shared tensor under both names); a
        different one under a tied `config` is refused."""
        if self.shape("output.weight") is None:
            return True
        if not config.tie_word_embeddings:
            return False
        if torch.equal(self.titan("output.weight"), self.titan("tok_embeddings.weight")):
            return True
        raise ConfigError(
            f"{self.path}: its output.weight is not its tok_embeddings.weight, but the "
            f"--model config ties them (tie_word_embeddings); give an untied config"
        )

    @property
    def dtype(self) -> str:
        """The dtype of the embedding's weights (an export writes it back)."""
        entry = self.tensors[self._key("tok_embeddings.weight")]
        return str(entry.properties.dtype).removeprefix("torch.")

    def titan(self, titan: str) -> torch.Tensor:
        """One tensor by its torchtitan name, as stored."""
        key = self._key(titan)
        entry = self.tensors[key]
        out = {key: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)}
        load_data(out, _Reader(self.path, self.metadata), self.path)
        return out[key]

    def canonical(self, name: str) -> torch.Tensor:
        """megapar's canonical tensor `name` (wq, wk permuted to transformers' rotary halves)."""
        tensor = self.titan(titan_name(name))
        q_heads, kv_heads = _heads(self.config)
        if name.endswith(".attn.q.weight"):
            tensor = to_rotate_half(tensor, q_heads)
        elif name.endswith(".attn.k.weight"):
            tensor = to_rotate_half(tensor, kv_heads)
        return tensor.contiguous()


def config_from_job(path: str, vocab_size: int):
    """A megapar LlamaConfig from torchtitan's job config TOML: its ``[model]`` name (llama3)
    and flavor (`FLAVORS`, with `TITAN_ROPE_SCALING`), ``[training] seq_len`` as the longest
    sequence (torchtitan's ``max_seq_len``; default 2048) and `vocab_size` (the tokenizer's:
    the checkpoint's)."""
    try:
        with open(path, "rb") as f:
            job = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"--job-config {path}: not a readable TOML file ({exc})") from None
    model = job.get("model", {})
    name, flavor = model.get("name"), model.get("flavor")
    if name not in ("llama3", None) or flavor not in FLAVORS:
        raise ConfigError(
            f"--job-config {path}: [model] name {name!r} flavor {flavor!r} is not "
            f"one of torchtitan's Llama 3 flavors ({', '.join(FLAVORS)}); give "
            f"--model SPEC (a megapar config.json with its sizes) instead"
        )
    args: dict[str, Any] = {
        "multiple_of": 256,
        "ffn_dim_multiplier": None,
        "norm_eps": 1e-5,
        **FLAVORS[flavor],
    }
    seq_len = job.get("training", {}).get("seq_len", 2048)
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=args["dim"],
        intermediate_size=intermediate_size(
            args["dim"], args["multiple_of"], args["ffn_dim_multiplier"]
        ),
        num_hidden_layers=args["n_layers"],
        num_attention_heads=args["n_heads"],
        num_key_value_heads=args.get("n_kv_heads") or args["n_heads"],
        max_position_embeddings=seq_len,
        rms_norm_eps=args["norm_eps"],
        rope_theta=float(args["rope_theta"]),
        rope_scaling=dict(TITAN_ROPE_SCALING),
        tie_word_embeddings=False,
    )


# --- import and export ---------------------------------------------------------------------
def import_dcp(
    dcp_dir,
    dst,
    tp: int,
    pp: int,
    dp: int = 1,
    config=None,
    job_config: str | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> tuple[Path, DCPReader]:
    """A megapar checkpoint (step 0, no optimizer state) from a torchtitan Llama DCP step
    directory, its config from `config` (a megapar model spec or config) or `job_config`
    (torchtitan's TOML)."""
    reader = DCPReader(dcp_dir, config, job_config)
    meta = {
        "imported_from_dcp": str(reader.path.resolve()),
        "hf_dtype": reader.dtype,
        "rng_note": "imported from a torchtitan DCP checkpoint: weights only (no RNG "
        "states, no optimizer state)",
    }
    path = write_weights(reader, dst, Layout(tp, pp, dp), meta, overwrite, progress)
    return path, reader


def export_dcp(src, dcp_dir, overwrite: bool = False) -> tuple[Path, dict]:
    """A DCP checkpoint of a megapar Llama's weights in torchtitan's names (wq, wk in its
    rotary layout; a tied embedding under ``output.weight`` too, as torchtitan's tied model
    saves it), written by ``torch.distributed.checkpoint.save`` in one process, each tensor in
    its checkpoint dtype; returns the directory and the torchtitan model args (its
    ``rope_scaling`` as `titans_rope` gives it, to compare with `TITAN_ROPE_SCALING`)."""
    step_dir = resolve_checkpoint(src)
    manifest = verify(step_dir)
    config = config_from_dict(manifest["model"])
    if config.model_type != "llama":
        raise CheckpointError(
            f"{src} holds a {config.model_type} model; --to-dcp writes "
            f"torchtitan's Llama checkpoints (a llama model)"
        )
    dst = output_dir(dcp_dir)
    _refuse_existing(dst, overwrite, (".metadata",), "DCP checkpoint")  # .metadata: its index
    check_output(dst)
    q_heads, kv_heads = _heads(config)
    reader = ShardReader(step_dir, manifest)
    state = {}
    for name, e in manifest["tensors"].items():
        if e.get("buffer"):  # not torchtitan's
            continue
        dim = e["tp_dim"]
        tensor = reader.shard(name, None, 1, 0, None if dim is None else e["full_shape"][dim])
        if name.endswith(".attn.q.weight"):
            tensor = to_interleaved(tensor, q_heads)
        elif name.endswith(".attn.k.weight"):
            tensor = to_interleaved(tensor, kv_heads)
        state[titan_name(name)] = tensor.contiguous()
    reader.release()
    if config.tie_word_embeddings:  # torchtitan's Llama loads output.weight, tied or not
        state["output.weight"] = state["tok_embeddings.weight"]
    remove_stale_temporaries(dst.parent, f".{dst.name}.tmp-")  # of an export killed -9
    tmp = staging_dir(dst.parent, f".{dst.name}.tmp-{owner_tag()}-")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dist_cp.save(state, checkpoint_id=str(tmp), no_dist=True)
        _swap_into(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    args = {
        "dim": config.hidden_size,
        "n_layers": config.num_hidden_layers,
        "n_heads": q_heads,
        "n_kv_heads": kv_heads,
        "vocab_size": config.vocab_size,
        "norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        **ffn_args(config.hidden_size, config.intermediate_size),
    }
    if config.tie_word_embeddings:
        args["enable_weight_tying"] = True
    args["rope_scaling"] = titans_rope(config.rope_scaling)
    return dst, args


def ffn_args(dim: int, size: int) -> dict:
    """torchtitan's ``multiple_of`` (and ``ffn_dim_multiplier`` where needed) that give the FFN
    size `size` at `dim` by its formula (`intermediate_size`; its model args name no FFN size):
    rounded up to a multiple of `size`, any hidden size from 1 to `size` is `size`."""
    base = int(2 * (4 * dim) / 3)
    args: dict = {"multiple_of": size}
    if size < base:  # scaled to size, not below 1
        args["ffn_dim_multiplier"] = (size + 0.5) / base
    return args


def titans_rope(scaling: dict | None) -> dict | None:
    """`scaling` (a LlamaConfig's rope_scaling, transformers' form) as `TITAN_ROPE_SCALING`'s
    fields, to compare with it: its type (``type`` in older configs) and numbers."""
    if not scaling:
        return None
    kind = scaling.get("rope_type", scaling.get("type"))
    return {k: kind if k == "rope_type" else scaling.get(k) for k in TITAN_ROPE_SCALING}
