"""An engine's weights exported as a Hugging Face model directory (`Engine.export_hf`)."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

from megapar.checkpoint.distributed import broadcast_text, save_checkpoint
from megapar.checkpoint.export import export_hf as export_checkpoint
from megapar.checkpoint.export import tokenizer_hint


def export_engine(
    engine,
    path: str | Path,
    tokenizer=None,
    dtype: str | None = None,
    allow_other_tokenizer: bool = False,
) -> Path:
    """What `Engine.export_hf` documents: the engine's state saved as a megapar checkpoint
    beside `path`, exported from there by rank 0 and removed; every rank returns `path` or
    raises together. Collective."""
    path = Path(path).absolute()
    tmp = path.parent / f".{path.name or 'export'}.megapar-export-{engine.step}"
    meta = {
        "step": engine.step,
        "hf_dtype": engine.source_dtype,
        "hf_generation_config": engine.source_generation_config,
        "tokenizer": engine.tokenizer,
    }
    save_checkpoint(tmp, engine.step, engine.saved_model(), engine.mesh, {}, meta, {})
    outcome = ""
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
            outcome = f"{type(exc).__name__}: {exc}"
        shutil.rmtree(tmp, ignore_errors=True)
        if not outcome and tokenizer is None and engine.tokenizer is None:
            warnings.warn(
                f"engine.export_hf({path}): no tokenizer given or known, the export has none "
                f"(AutoTokenizer cannot load it); {tokenizer_hint(engine.config, api=True)}",
                stacklevel=3,
            )
    outcome = broadcast_text(outcome, engine.mesh)
    if outcome:
        raise RuntimeError(f"export to {path} failed: {outcome}")
    return path
