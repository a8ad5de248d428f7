"""An engine's weights exported as a Hugging Face model directory (`Engine.export_hf`)."""

from __future__ import annotations

import importlib
import shutil
import warnings
from pathlib import Path

from megapar.checkpoint.distributed import save_checkpoint
from megapar.checkpoint.export import export_hf as export_checkpoint
from megapar.checkpoint.export import tokenizer_hint
from megapar.faults.processes import owner_tag, remove_stale_temporaries
from megapar.faults.status import set_action
from megapar.mesh import broadcast_text


def export_engine(
    engine,
    path: str | Path,
    tokenizer=None,
    dtype: str | None = None,
    allow_other_tokenizer: bool = False,
) -> Path:
    """What `Engine.export_hf` documents: the engine's state saved as a megapar checkpoint
    beside `path` (named with rank 0's `owner_tag`, so the next export removes one whose rank 0
    was killed), exported from there by rank 0 and removed; every rank returns `path` or
    raises together (rank 0 its exception, every other rank one of its type, or of the nearest
    megapar or builtin class it derives from, with its message: `failure` / `raise_failure`).
    Collective."""
    path = Path(path).absolute()
    prefix = f".{path.name or 'export'}.megapar-export-"
    if engine.mesh.rank == 0:
        remove_stale_temporaries(path.parent, prefix)  # of an export whose rank 0 was killed
    tag = broadcast_text(owner_tag() if engine.mesh.rank == 0 else None, engine.mesh)
    tmp = path.parent / f"{prefix}{tag}-{engine.step}"
    meta = {
        "step": engine.step,
        "hf_dtype": engine.source_dtype,
        "hf_generation_config": engine.source_generation_config,
        "tokenizer": engine.tokenizer,
    }
    set_action(f"engine.export_hf: saving the weights to export to {tmp}")
    save_checkpoint(tmp, engine.step, engine.saved_model(), engine.mesh, {}, meta, {})
    outcome, error = "", None
    set_action(f"engine.export_hf: rank 0 writing the export {path}")
    if engine.mesh.rank == 0:
        try:
            export_checkpoint(
                tmp,
                path,
                overwrite=True,
                tokenizer=tokenizer,
                dtype=dtype,
                allow_other_tokenizer=allow_other_tokenizer,
                api=True,
            )
        except Exception as exc:  # noqa: BLE001 - raised on every rank below
            outcome, error = failure(exc), exc
        finally:  # a Ctrl-C too: the next export, in this live process, would not remove it
            shutil.rmtree(tmp, ignore_errors=True)
        if not outcome and tokenizer is None and engine.tokenizer is None:
            warnings.warn(
                f"engine.export_hf({path}): no tokenizer given or known, the export has none "
                f"(AutoTokenizer cannot load it); {tokenizer_hint(engine.config, api=True)}",
                stacklevel=3,
            )
    outcome = broadcast_text(outcome, engine.mesh)
    if error is not None:
        raise error
    if outcome:
        raise_failure(outcome)
    return path


def _portable(exc: Exception) -> type[Exception]:
    """The first class of `exc`'s that every rank has, by its module and name: megapar's own
    or a builtin one (a library's OSError subclass: OSError; not one made inside a function)."""
    for cls in type(exc).__mro__:
        ours = cls.__module__ == "builtins" or cls.__module__.partition(".")[0] == "megapar"
        if ours and "<locals>" not in cls.__qualname__:
            return cls
    return RuntimeError  # not reached: Exception is a builtin


def failure(exc: Exception) -> str:
    """`exc` as text another rank raises again (`raise_failure`): its portable class
    (`_portable`) and its message."""
    cls = _portable(exc)
    return f"{cls.__module__}:{cls.__qualname__}\n{exc}"


def raise_failure(text: str) -> None:
    """Raise the exception `failure` wrote: its class with its message (a RuntimeError naming
    the class where that class does not take a message alone)."""
    name, _, message = text.partition("\n")
    module, _, qualname = name.partition(":")
    cls: object = importlib.import_module(module)
    for part in qualname.split("."):
        cls = getattr(cls, part)
    assert isinstance(cls, type) and issubclass(cls, Exception)  # as `failure` named it
    try:
        exc = cls(message)
    except Exception:  # noqa: BLE001 - a class with more arguments (UnicodeDecodeError)
        exc = RuntimeError(f"{cls.__name__}: {message}")
    raise exc
