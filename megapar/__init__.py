"""megapar: 3D-parallel (tensor / pipeline / data) transformer training that gives the same numbers
in any layout.

The public API (imported lazily, so `import megapar` stays cheap):

- `megapar.launch(fn, nprocs, *args)`: run `fn` on nprocs local ranks (the notebook launcher);
  rank 0's return value. Under torchrun / Slurm it just calls `fn`.
- `megapar.prepare(model, tp=, pp=, micro_batch_size=, ...)`: inside `fn`, shard a transformers
  GPT2LMHeadModel / BertForMaskedLM / LlamaForCausalLM / Qwen3ForCausalLM / Qwen2ForCausalLM /
  MistralForCausalLM / MixtralForCausalLM / Qwen3MoeForCausalLM / DeepseekV3ForCausalLM (or
  config, or recipe name)
  and return its `Engine`: `engine.train_step(batch)`, `eval_step`, `save`, `wait_save`, `load`,
  `export_hf`, `stragglers`, `optimizer`, `mesh`, `step`.
"""

__version__ = "0.1.0"

_LAZY = {
    "launch": ("megapar.launcher", "launch"),
    "WorkerError": ("megapar.launcher", "WorkerError"),
    "prepare": ("megapar.training.prepare", "prepare"),
    "Engine": ("megapar.training.engine", "Engine"),
}

__all__ = ["launch", "prepare", "Engine", "WorkerError", "__version__"]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'megapar' has no attribute {name!r}")


def __dir__():
    """The module's names with the lazy public ones, so `dir(megapar)` and a notebook's
    completion (`megapar.<Tab>`) show `prepare` and `launch` before their first use."""
    return sorted(set(globals()) | set(_LAZY))
