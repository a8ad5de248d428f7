"""Crash-safe publishing of a checkpoint step, repair on load, and cleaning stale staging dirs.

`publish_step` turns a complete staging directory into ``ROOT/step_N`` and points ``latest`` at
it. A crash (kill -9, power loss) at any point leaves a root that loads:

1. (re-saving an existing step) ``step_N`` is moved aside to ``.old-step_N-*``;
2. the staging directory ``.tmp-step_N-*`` (manifest written last) is renamed to ``step_N``;
3. ``latest`` is replaced atomically (written to a temporary file, renamed); where it cannot
   be written (a full disk), ``step_N`` is removed again (and one moved aside put back), so the
   save fails as a whole;
4. ``.old-step_N-*`` is deleted.

Between 1 and 2 ``latest`` names a missing directory while two complete copies exist:
`recover` (called when a load finds ``latest`` dangling) renames the newer complete copy into
place, or names it when the root is read-only. A crash before the first ``latest`` is written
leaves complete ``step_*`` directories: a load takes the newest. Staging directories carry an
owner file (host, pid); `clean_stale` deletes those whose process is gone, never the complete
copy that a dangling ``latest`` needs.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import socket
from pathlib import Path

from megapar.checkpoint.format import LATEST, MANIFEST, CheckpointError, fsync_dir
from megapar.data.inputs import named_datasets, tokenized_datasets
from megapar.faults.processes import pid_alive
from megapar.made_dirs import keep_mode
from megapar.one_line_parser import shell_word

OWNER = ".owner"

#: Tests replace this to kill the process at a named point of `publish_step` ("start",
#: "after-aside", "after-rename", "after-latest-tmp", "after-latest").
crash_point = None


def _crash(where: str) -> None:
    if crash_point is not None:
        crash_point(where)


def mark_owner(staging: Path) -> None:
    """Record which process builds `staging` (so a later run can tell a dead one's leftovers)."""
    (staging / OWNER).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))


def set_latest(root: str | Path, step_name: str) -> None:
    """Atomically point ``root/latest`` at a step directory."""
    root = Path(root)
    tmp = root / f".latest.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        with open(tmp, "w") as f:
            keep_mode(tmp, root / "latest")  # a private 0600 latest stays so (a re-test)
            f.write(step_name + "\n")
            f.flush()
            os.fsync(f.fileno())
    except OSError:  # a full disk: no temporary is left beside latest
        tmp.unlink(missing_ok=True)
        raise
    _crash("after-latest-tmp")
    os.replace(tmp, root / "latest")
    fsync_dir(root)


def publish_step(tmp: Path, root: str | Path, step_name: str) -> Path:
    """Rename a complete, fsynced staging directory to ``root/step_name``; update ``latest``."""
    root = Path(root)
    _crash("start")
    fsync_dir(tmp)
    final = root / step_name
    old = None
    if final.exists():
        old = root / f".old-{step_name}-{secrets.token_hex(4)}"
        os.rename(final, old)
        fsync_dir(root)
        _crash("after-aside")
    os.rename(tmp, final)
    fsync_dir(root)
    _crash("after-rename")
    try:
        (final / OWNER).unlink(missing_ok=True)
        set_latest(root, step_name)
    except OSError:  # a full disk: the step is taken back, as the error says it is not saved
        _withdraw(final, old)
        raise
    _crash("after-latest")
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _withdraw(final: Path, old: Path | None) -> None:
    """Undo `publish_step`'s rename where ``latest`` could not be written: remove `final` (its
    space is what a full disk lacks; left, it would be a complete step that the error called
    not saved, and a requeue's save would fail beside it) and put a step moved aside back."""
    shutil.rmtree(final, ignore_errors=True)
    if old is not None and not final.exists():
        try:
            os.rename(old, final)
        except OSError:  # left as .old-step_N-*: `recover` or the next save's clean-up finds it
            pass
    try:
        fsync_dir(final.parent)
    except OSError:
        pass


def _copies(root: Path, step_name: str) -> list[Path]:
    """Complete hidden copies of `step_name` (staging or moved aside), newest first."""
    n = int(step_name.split("_")[1])
    found = [p for p in root.glob(f".tmp-step_{n}-*") if (p / MANIFEST).exists()]
    found += [p for p in root.glob(f".old-{step_name}-*") if (p / MANIFEST).exists()]
    return sorted(found, key=lambda p: (p / MANIFEST).stat().st_mtime, reverse=True)


def recover(root: Path, step_name: str) -> str | None:
    """``latest`` names `step_name`, which is missing: put the newest complete copy in place.

    Returns None when repaired, else a sentence for the error (the copy to use, or none)."""
    final = root / step_name
    copies = _copies(root, step_name)
    if not copies:
        return "no complete copy of it was found"
    try:
        os.rename(copies[0], final)
        fsync_dir(root)
        (final / OWNER).unlink(missing_ok=True)
    except OSError as exc:
        if (final / MANIFEST).exists():  # another rank repaired it first
            return None
        return (
            f"a complete copy is in {copies[0]} but could not be moved into place ({exc}); "
            f"rename it to {final}"
        )
    return None


def newest_step(root: Path) -> Path | None:
    """The highest complete ``step_*`` directory of a root without ``latest``."""
    steps = sorted(p for p in root.glob("step_*") if (p / MANIFEST).exists())
    return steps[-1] if steps else None


def steps_after(root: str | Path, step: int) -> list[str]:
    """The complete ``step_N`` directories of `root` with N > `step`, oldest first (none when
    `root` is not a directory)."""
    root = Path(root).expanduser()
    if not root.is_dir():
        return []
    found = [
        (int(p.name[5:]), p.name)
        for p in root.glob("step_*")
        if re.fullmatch(r"step_\d+", p.name) and (p / MANIFEST).exists()
    ]
    return [name for n, name in sorted(found) if n > step]


def remove_steps_after(root: str | Path, step: int) -> list[str]:
    """Remove the complete ``step_N`` directories of `root` with N > `step`, and the records
    (``records/step_N.*``) of those steps (a run started from `step` with --overwrite-newer
    replaces them): ``latest`` is first pointed at the newest step left (removed when none is
    left), so a crash in between leaves a root that loads. Returns the removed steps' names."""
    root = Path(root).expanduser()
    newer = steps_after(root, step)
    latest = root / LATEST
    if newer and latest.exists() and latest.read_text().strip() in newer:
        left = [name for name in steps_after(root, -1) if name not in newer]
        if left:
            set_latest(root, left[-1])
        else:
            latest.unlink()
    for name in newer:
        shutil.rmtree(root / name)
    for record in (
        sorted((root / "records").glob("step_*.*")) if (root / "records").is_dir() else []
    ):
        n = record.name[5:].split(".")[0]
        if n.isdigit() and int(n) > step:
            record.unlink()
    if newer:
        fsync_dir(root)
    return newer


def remove_steps_before_latest(root: str | Path, keep: int) -> list[str]:
    """Remove the complete ``step_N`` directories of `root` but the newest `keep` (by N) and
    the one ``latest`` names (--keep-latest-k); returns the removed steps' names, oldest
    first. Each is renamed to a hidden ``.dropped-`` name before it is deleted, so a crash
    mid-delete leaves a hidden leftover (which `clean_stale` deletes), never a half step among
    those a load takes."""
    root = Path(root).expanduser()
    steps = steps_after(root, -1)
    latest = root / LATEST
    named = latest.read_text().strip() if latest.is_file() else None
    removed = [name for name in steps[: max(0, len(steps) - keep)] if name != named]
    for name in removed:
        aside = root / f".dropped-{name}-{secrets.token_hex(4)}"
        os.rename(root / name, aside)
        shutil.rmtree(aside, ignore_errors=True)
    if removed:
        fsync_dir(root)
    return removed


def has_checkpoint(path: str | Path) -> bool:
    """Whether `path` holds something to resume from (else a requeued run starts fresh)."""
    p = Path(path).expanduser()
    return p.is_dir() and (
        (p / MANIFEST).exists() or (p / "latest").exists() or newest_step(p) is not None
    )


def _megatron_metadata(path: Path) -> bool:
    """Whether `path` is Megatron-core's ``metadata.json`` (it names a ``sharded_backend``)."""
    try:
        return "sharded_backend" in json.loads(path.read_text())
    except (OSError, ValueError, TypeError):
        return False


DEEPSPEED_FILE = re.compile(r".*_(model|optim)_states\.pt")
"""The pickles a DeepSpeed engine saves in ``global_stepN/`` (``mp_rank_00_model_states.pt``,
``zero_pp_rank_0_mp_rank_00_optim_states.pt``, ``bf16_zero_pp_rank_0_..._optim_states.pt``)."""


def _deepspeed_files(d: Path) -> list[str]:
    try:
        names = [x.name for x in d.iterdir() if DEEPSPEED_FILE.fullmatch(x.name)]
        return sorted(names, key=lambda n: (not n.endswith("_model_states.pt"), n))
    except OSError:
        return []


def deepspeed_checkpoint(path: str | Path) -> str | None:
    """What `path` is when it is a DeepSpeed checkpoint, and how to bring it in, in one phrase
    (after the path); None when it is not one. Seen: a root (``latest`` naming
    ``global_stepN``, or ``global_step*/`` directories of ``*_model_states.pt`` /
    ``*_optim_states.pt``), one such step directory, or one of its files. megapar loads no
    pickle, so the way in is DeepSpeed's own consolidation to safetensors."""
    p = Path(path).expanduser()
    step_dir: Path | None = None  # the step given, which zero_to_fp32.py reads by --tag
    if p.is_file():
        if not DEEPSPEED_FILE.fullmatch(p.name):
            return None
        example = p.name
        in_step = p.parent.name.startswith("global_step")
        root = p.parent.parent if in_step else p.parent
        step_dir = p.parent if in_step else None
        what = "is a file of a DeepSpeed checkpoint"
    elif p.is_dir():
        files = _deepspeed_files(p)
        if files:
            example = files[0]
            in_step = p.name.startswith("global_step")
            root = p.parent if in_step else p
            step_dir = p if in_step else None
        else:
            tag = _latest_tag(p)
            steps = sorted(
                (d for d in p.glob("global_step*") if _deepspeed_files(d)), key=_step_number
            )
            named = p / tag if PLAIN_STEP.fullmatch(tag) and (p / tag).is_dir() else None
            if named is None and not steps:
                return None
            plain = [d for d in steps if PLAIN_STEP.fullmatch(d.name)]  # not a universal one
            step_dir = named if named is not None else (plain or steps)[-1]  # newest by N
            files = _deepspeed_files(step_dir)
            example = f"{step_dir.name}/{files[0] if files else 'mp_rank_00_model_states.pt'}"
            root = p
        what = "holds a DeepSpeed checkpoint"
    else:
        return None
    if step_dir is not None and (step_dir / "zero").is_dir():  # ds_to_universal's output
        return (
            f"{what} ({example}: pickles, which megapar never loads), not a megapar "
            f"checkpoint: a DeepSpeed universal checkpoint, which zero_to_fp32.py does not "
            f"read; resume it in DeepSpeed (--universal-checkpoint), save, consolidate that "
            f"step with zero_to_fp32.py, then megapar-convert --from-hf OUT_DIR CKPT_DIR"
        )
    script = root / "zero_to_fp32.py"
    run = shell_word(script) if script.is_file() else "zero_to_fp32.py"
    tag = (  # zero_to_fp32.py reads the step `latest` names, any other by --tag
        f" --tag {shell_word(step_dir.name)}"
        if step_dir is not None and step_dir.name != _latest_tag(root)
        else ""
    )
    return (
        f"{what} ({example}: pickles, which megapar never loads), not a megapar checkpoint; "
        f"consolidate it with DeepSpeed's zero_to_fp32.py (python {run} {shell_word(root)} "
        f"OUT_DIR{tag} --safe_serialization), copy the model's config.json into OUT_DIR, then "
        f"megapar-convert --from-hf OUT_DIR CKPT_DIR"
    )


PLAIN_STEP = re.compile(r"global_step\d+")
"""A DeepSpeed step directory's name (``global_stepN``; ``global_stepN_universal`` is
ds_to_universal's)."""


def _latest_tag(root: Path) -> str:
    """The step a DeepSpeed checkpoint root's ``latest`` names ("" where it has none)."""
    try:
        return (root / LATEST).read_text(errors="replace").strip()
    except OSError:
        return ""


def _step_number(d: Path) -> int:
    """N of a DeepSpeed ``global_stepN`` directory (of ``global_stepN_universal`` too)."""
    found = re.match(r"global_step(\d+)", d.name)
    return int(found.group(1)) if found else -1


def titan_steps(folder: Path) -> list[str]:
    """The step directories (``step-N`` holding a DCP ``.metadata``) of torchtitan checkpoint
    folder `folder`, oldest first (by N: step-9 before step-10)."""
    steps = [d.name for d in folder.glob("step-*") if (d / ".metadata").is_file()]
    return sorted(steps, key=lambda n: (len(n), n))


def foreign_checkpoint(path: str | Path) -> str | None:
    """What another framework's checkpoint in directory `path` is, and the command that imports
    it, in one phrase; None when `path` holds none (or is a megapar checkpoint). Seen: a DCP
    checkpoint (torchtitan's step-N: ``.metadata``, ``*.distcp``), a torchtitan checkpoint
    folder of such steps, a Hugging Face model (config.json), safetensors weights without a
    config.json (torchtitan's ``--checkpoint.last-save-in-hf`` output), a Megatron-LM checkpoint
    (a root with ``latest_checkpointed_iteration.txt``, a torch_dist save's ``metadata.json``,
    the legacy ``mp_rank_XX/model_optim_rng.pt``), a DeepSpeed checkpoint
    (`deepspeed_checkpoint`); and tokenized datasets (`tokenized_datasets`), which are no
    checkpoint of any kind."""
    p = Path(path).expanduser()
    deepspeed = deepspeed_checkpoint(p) if p.is_dir() else None
    if deepspeed is not None:
        return deepspeed
    if not p.is_dir() or has_checkpoint(p):
        return None
    megatron = (
        (p / "latest_checkpointed_iteration.txt").is_file()
        or _megatron_metadata(p / "metadata.json")
        or (p / "model_optim_rng.pt").is_file()
        or any(p.glob("mp_rank_*"))
    )
    if megatron:
        return (
            f"holds a Megatron-LM checkpoint, not a megapar checkpoint; import a Megatron GPT "
            f"with megapar-convert --from-megatron {shell_word(path)} CKPT_DIR (the model from "
            f"its recorded args, or --model SPEC), then --load CKPT_DIR"
        )
    if (p / ".metadata").is_file() or any(p.glob("*.distcp")):
        what = (
            "a torch.distributed.checkpoint (DCP) checkpoint (.metadata, *.distcp), as "
            "torchtitan saves"
            if (p / ".metadata").is_file()
            else "*.distcp files of a DCP checkpoint without its .metadata (an interrupted save?)"
        )
        return (
            f"holds {what}, not a megapar checkpoint; import a torchtitan Llama with "
            f"megapar-convert --from-dcp {shell_word(path)} CKPT_DIR --job-config JOB.toml "
            f"(or --model SPEC), then --load CKPT_DIR"
        )
    steps = titan_steps(p)
    if steps:
        return (
            f"holds torchtitan's DCP checkpoints ({', '.join(steps[-3:])}), not a megapar "
            f"checkpoint; import one with megapar-convert --from-dcp {shell_word(p / steps[-1])} "
            f"CKPT_DIR --job-config JOB.toml, then --load CKPT_DIR"
        )
    if (p / "config.json").is_file():
        return (
            f"holds a Hugging Face model (config.json), not a megapar checkpoint; start from "
            f"it with --from-hf {shell_word(path)} (or import it: megapar-convert --from-hf "
            f"{shell_word(path)} CKPT_DIR)"
        )
    if (p / "model.safetensors").is_file() or (p / "model.safetensors.index.json").is_file():
        return (
            f"holds Hugging Face-style safetensors weights without a config.json, not a "
            f"megapar checkpoint; add the model's config.json there, then start from it "
            f"with --from-hf {shell_word(path)} (or megapar-convert --from-hf "
            f"{shell_word(path)} CKPT_DIR)"
        )
    found = tokenized_datasets(p)
    if found:
        return (
            f"holds tokenized datasets ({named_datasets(found)}: megapar-data's .bin / .idx), not "
            f"a megapar checkpoint; pass a dataset's prefix to --data (--data "
            f"{shell_word(found[0])}: megapar-train's, megapar-eval's) and a checkpoint to --load"
        )
    pickled = sorted(f.name for f in p.iterdir() if f.suffix in PICKLED_SUFFIXES and _saved(f))
    if pickled:
        return (
            f"holds a PyTorch checkpoint ({', '.join(pickled[:3])}: torch.save's pickle), not a "
            f"megapar checkpoint, which megapar does not read (pickles run code when loaded); "
            f"save the model with transformers' save_pretrained (safetensors) and start from it "
            f"with --from-hf DIR"
        )
    return None


PICKLED_SUFFIXES = frozenset({".pt", ".pth", ".bin", ".ckpt"})
"""torch.save's files as other tools name them (a Lightning .ckpt, pytorch_model.bin without
its config.json): a directory of them is a checkpoint megapar does not read."""

LEGACY_MAGIC = (0x1950A86A20F9469CFC6C).to_bytes(10, "little")
"""The number torch.save's legacy (pre-zip) format pickles first, whatever the protocol."""


def _saved(path: Path) -> bool:
    """Whether file `path` is a pickle as torch.save writes one: its zip archive (torch >= 1.6),
    the legacy format (its magic number in the first bytes), or, for a .pt / .pth / .ckpt, any
    pickle (protocol 2 to 5: `pickle.dump`'s too). A .bin of tokens (megapar-data's) is none,
    whatever its first ids."""
    try:
        with open(path, "rb") as f:
            head = f.read(32)
    except OSError:
        return False
    if head.startswith(b"PK\x03\x04") or LEGACY_MAGIC in head:
        return True
    return (
        path.suffix != ".bin"
        and head[:1] == b"\x80"
        and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05")
    )


def _owner_gone(path: Path) -> bool:
    try:
        if path.is_file():  # .latest.tmp-{pid}-*
            owner = {"host": socket.gethostname(), "pid": path.name.split("-")[1]}
        else:
            owner = json.loads((path / OWNER).read_text())
    except (OSError, ValueError, IndexError):
        return False  # no owner file: not ours to judge
    if owner.get("host") != socket.gethostname():
        return False
    try:
        return not pid_alive(int(owner["pid"]))
    except (KeyError, ValueError):
        return False


def clean_stale(root: str | Path) -> list[str]:
    """Delete leftovers of dead saves in `root`; returns their names.

    ``.tmp-step_*`` whose owner process (on this host) is gone, and ``.old-step_*`` whose step
    is in place again, ``.latest.tmp-{pid}-*`` of dead processes, ``.dropped-step_*`` (a step
    `remove_steps_before_latest` was deleting); never the complete copy `recover` needs, of the
    step ``latest`` names while that step is missing. A complete staging copy of any other step
    (its save failed before the rename) is deleted with its dead owner: nothing loads it."""
    root = Path(root)
    removed: list[str] = []
    if not root.is_dir():
        return removed
    try:
        latest = (root / LATEST).read_text().strip()
    except OSError:
        latest = ""
    for p in root.iterdir():
        if p.name.startswith(".old-step_"):
            step_name = p.name[len(".old-") :].rsplit("-", 1)[0]
            stale = (root / step_name / MANIFEST).exists()
        elif p.name.startswith(".tmp-step_"):
            n = p.name[len(".tmp-step_") :].split("-", 1)[0]
            step_name = f"step_{int(n):08d}" if n.isdigit() else ""
            needed = (
                step_name == latest
                and (p / MANIFEST).exists()
                and not (root / step_name / MANIFEST).exists()
            )
            stale = _owner_gone(p) and not needed
        elif p.name.startswith(".latest.tmp-"):
            stale = _owner_gone(p)
        elif p.name.startswith(".dropped-step_"):
            stale = True
        else:
            continue
        if stale and p.is_file():
            p.unlink(missing_ok=True)
        elif stale:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p.name)
    return sorted(removed)


def resolve_checkpoint(path: str | Path) -> Path:
    """The step directory of `path`: a step directory itself, or a ROOT (follows ``latest``);
    a leading ``~`` is the home directory, as the checks before the workers read it."""
    path = Path(path).expanduser()
    if (path / MANIFEST).exists():
        return path
    deepspeed = deepspeed_checkpoint(path)
    if deepspeed is not None:
        raise CheckpointError(f"{path} {deepspeed}")
    if (path / LATEST).exists():
        name = (path / LATEST).read_text().strip()
        if not re.fullmatch(r"step_\d+", name):  # never a path out of the root
            raise CheckpointError(
                f"{path}/latest holds {name[:80]!r}, not the name of a step "
                f"directory in {path} (step_N); write the step to resume "
                f"there, or pass a step directory explicitly"
            )
        step = path / name
        if not (step / MANIFEST).exists():
            problem = recover(path, step.name)
            if problem is not None:
                raise CheckpointError(
                    f"{path}/latest points to {step.name}, which has no "
                    f"{MANIFEST} (deleted or moved?); {problem}; pass a step "
                    f"directory explicitly"
                )
        return step
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if path.is_file():  # e.g. the manifest or a shard of a step directory
        holder = path.parent
        raise CheckpointError(
            f"{path} is a file, not a checkpoint directory; pass "
            + (
                f"the directory that holds it, {holder}"
                if (holder / MANIFEST).exists() or (holder / LATEST).exists()
                else "a directory written by --save (or one of its step_* directories)"
            )
        )
    newest = newest_step(path)
    if newest is not None:  # a crash before the first `latest` was written
        return newest
    if (path / "config.json").exists():
        raise CheckpointError(
            f"{path} holds a Hugging Face model (config.json), not a megapar "
            f"checkpoint; import it with megapar-convert --from-hf {shell_word(path)} "
            f"CKPT_DIR (or train from it: megapar-train --from-hf {shell_word(path)})"
        )
    foreign = foreign_checkpoint(path)
    if foreign is not None:
        raise CheckpointError(f"{path} {foreign}")
    raise CheckpointError(
        f"{path}: neither a checkpoint step directory (no {MANIFEST}) nor a checkpoint root (no "
        f"{LATEST} file); pass the --save directory of a run, or one of its step_* directories "
        f"(an interrupted first save leaves neither)"
    )
