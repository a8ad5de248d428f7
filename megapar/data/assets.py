"""Files shipped inside the package (``megapar/assets``): the GPT-2 BPE, a small SentencePiece
model, the Shakespeare sample the default job trains on."""

from __future__ import annotations

from pathlib import Path


def asset_path(name: str) -> str:
    """Absolute path of a file shipped in ``megapar/assets`` (e.g. ``"gpt2_vocab.json"``)."""
    path = Path(__file__).resolve().parent.parent / "assets" / name
    if not path.is_file():
        raise FileNotFoundError(
            f"megapar asset {name!r} not found at {path}; the package install is incomplete "
            "-- reinstall megapar (pip install -e .) so that megapar/assets/* is included"
        )
    return str(path)


def moved_asset(path: str) -> str | None:
    """This install's copy of a file that `path` names in another install's ``megapar/assets``
    (a dataset index, cache entry or checkpoint written by a megapar since moved, reinstalled
    or run from another checkout), or None when `path` exists or is no such file."""
    p = Path(path)
    if p.exists() or p.parent.name != "assets" or p.parent.parent.name != "megapar":
        return None
    here = Path(__file__).resolve().parent.parent / "assets" / p.name
    return str(here) if here.is_file() else None
