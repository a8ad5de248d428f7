"""Metrics of a training run: the progress bar, log lines, JSON lines, TensorBoard and W&B.

Only the rank that logs (global rank 0) creates a `MetricsLogger`; the others get a
`NullLogger`. FLOPs per token, for TFLOP/s and MFU, are the model's matmul FLOPs forward and
backward (`megapar.models.flops.training_flops_per_token`, shared with megapar-plan).
"""

from __future__ import annotations

import json
import math
import os
import resource
import socket
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlparse

import torch
from tqdm.auto import tqdm

from megapar.diagnostics.straggler import Straggler
from megapar.disk import DISK_ERRORS
from megapar.faults.stop import RunStopped
from megapar.one_line_parser import show_progress
from megapar.wording import scale_text


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory of this process as the OS sees it: on CUDA the device memory torch's
    allocator held at its peak (reserved, not only allocated to tensors), on the CPU the peak
    resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / 2**20
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb / 1024 if sys.platform != "darwin" else kb / 2**20


WANDB_MODES = ("online", "offline", "disabled", "shared", "dryrun", "run")
"""The values W&B's settings take for WANDB_MODE (wandb 0.31's ``Settings.mode``)."""


def wandb_mode(timeout_s: float = 2.0) -> tuple[str, str]:
    """(mode, reason): WANDB_MODE when set; else online when the W&B server answers and
    credentials exist (WANDB_API_KEY or ~/.netrc), offline otherwise (sync later with
    `wandb sync`)."""

    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"], "WANDB_MODE"
    url = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai"))
    host, port = url.hostname or "api.wandb.ai", url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError:
        return "offline", f"{host} unreachable; sync later with `wandb sync`"
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    if os.environ.get("WANDB_API_KEY") or (netrc.exists() and host in netrc.read_text()):
        return "online", f"{host} reachable"
    return "offline", "no W&B credentials (wandb login); sync later with `wandb sync`"


def keep_records_up_to(path: str, step: int) -> None:
    """Drop the records of steps after `step` from a --log-json file (a run resumed from the
    checkpoint of `step` trains them again, so each step is logged once), and a last line cut
    short by a crash; other lines are kept. The file is replaced atomically; a missing one is
    left missing."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.readlines()
    except FileNotFoundError:
        return

    def later(line: str) -> bool:
        try:
            record = json.loads(line)
        except ValueError:
            return not line.endswith("\n")  # only the last line can lack one: cut short
        return (
            isinstance(record, dict)
            and isinstance(record.get("step"), int)
            and record["step"] > step
        )

    kept = [line for line in lines if not later(line)]
    if len(kept) == len(lines):
        return
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(kept)
    os.replace(tmp, path)


def wandb_run_to_continue(
    project: str, start_step: int, recorded: dict | None
) -> tuple[str | None, str | None]:
    """(run id, what to say) for `wandb.init` in a run that starts at `start_step`, where the
    checkpoint it resumed from recorded the W&B run that saved it (`recorded`: {"project",
    "id"}, `MetricsLogger.checkpoint_meta`): that run's id, to continue it, when the run is
    resumed in the same --wandb-project; None for a fresh run, for one that names another run
    (WANDB_RUN_ID, which wandb reads, as WANDB_RESUME) and for another project, where the
    checkpoint's run is not."""
    if start_step == 0 or not recorded or not recorded.get("id"):
        return None, None
    run_id = str(recorded["id"])
    named = os.environ.get("WANDB_RUN_ID")
    if named and named != run_id:
        return None, f"W&B: run {named} (WANDB_RUN_ID), not the checkpoint's run {run_id}"
    if recorded.get("project") != project:
        return None, (
            f"W&B: a new run in project {project} (the checkpoint's run {run_id} is in "
            f"project {recorded.get('project')})"
        )
    return run_id, f"W&B: continuing run {run_id} from step {start_step}"


class NullLogger:
    def log(self, step: int, metrics: dict) -> None: ...
    def message(self, text: str) -> None: ...
    def advance(self, step: int, loss: float | None) -> None: ...
    def end_progress(self) -> None: ...
    def close(self) -> None: ...

    def checkpoint_meta(self) -> dict:
        """What a checkpoint records of this logger (the W&B run, `MetricsLogger`'s)."""
        return {}


class MetricsLogger(NullLogger):
    """Rank 0's logger: tqdm progress bar, console lines, --log-json, TensorBoard, W&B.

    A run resumed at `start_step` continues the W&B run its checkpoint recorded (`wandb_run`,
    `wandb_run_to_continue`). W&B's history of a run only grows: the steps the earlier run
    logged after the checkpoint stay as it logged them, and this run logs from the first step
    the run does not hold yet (`starting_step`, which W&B tells an online run; offline, a run
    sees none held and logs every step, for `wandb sync` to upload to the same run)."""

    def __init__(self, cfg, start_step: int, run_config: dict, wandb_run: dict | None = None):
        self.bar = None
        if show_progress(cfg.progress):
            self.bar = tqdm(
                total=cfg.max_steps,
                initial=start_step,
                desc="train",
                dynamic_ncols=True,
                file=sys.stderr,
            )
        self.json = None
        self.json_flag = f"--log-json {cfg.log_json}"
        self.json_path = cfg.log_json
        self.json_new = bool(cfg.log_json) and not os.path.exists(cfg.log_json)
        self.json_whole = 0
        """The bytes of --log-json that hold whole records (cut back to them on a full disk)."""
        self.tb_flag = f"--tensorboard {cfg.tensorboard}"
        if cfg.log_json:  # a fresh run starts the file, a resumed one continues it
            with _naming(self.json_flag):
                Path(cfg.log_json).parent.mkdir(parents=True, exist_ok=True)
                if start_step > 0:
                    keep_records_up_to(cfg.log_json, start_step)
                self.json = open(cfg.log_json, "a" if start_step > 0 else "w", buffering=1)
                self.json_whole = self.json.tell()
        self.tb = None
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # a resumed run's steps replace those an earlier run logged after its checkpoint
            # (TensorBoard purges events from purge_step on), as --log-json is trimmed
            with _naming(self.tb_flag):
                _quiet_tensorboard_thread()
                self.tb = SummaryWriter(
                    cfg.tensorboard, purge_step=start_step + 1 if start_step > 0 else None
                )
        self.wandb = None
        self.wandb_project = cfg.wandb_project
        self.wandb_from = 0
        """The first step W&B takes: a continued run's steps before it are the earlier run's."""
        if cfg.wandb_project:
            import wandb

            mode, why = wandb_mode()
            self.message(f"W&B: {mode} ({why})")
            run_id, said = wandb_run_to_continue(cfg.wandb_project, start_step, wandb_run)
            if said:
                self.message(said)
            self.wandb = wandb.init(
                project=cfg.wandb_project,
                config=run_config,
                mode=mode,  # type: ignore[arg-type]  # WANDB_MODE as given: wandb checks it
                id=run_id,
                resume="allow" if run_id else None,
            )
            self.wandb_from = int(getattr(self.wandb, "starting_step", 0) or 0)
            if self.wandb_from > start_step + 1:
                self.message(
                    f"W&B: run {self.wandb.id} holds steps {start_step + 1}-"
                    f"{self.wandb_from - 1} from an earlier run, which it keeps (a W&B run's "
                    f"history only grows); this run logs to it from step {self.wandb_from}"
                )

    def message(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def advance(self, step: int, loss: float | None) -> None:
        if self.bar is not None:
            self.bar.n = step
            if loss is not None:
                self.bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
            self.bar.refresh()

    def end_progress(self) -> None:
        """Take the progress bar off the terminal (a run that ends with a report, not a
        trained step: --replay); messages print as plain lines from here on."""
        if self.bar is not None:
            self.bar.leave = False
            self.bar.close()
            self.bar = None

    def log(self, step: int, metrics: dict) -> None:
        """One JSON line per call (with ``time``: the Unix time it was written, so the gaps
        between steps, a save's pause, can be read off the file); scalars to TensorBoard /
        W&B."""
        record = {"step": step, **metrics, "time": round(time.time(), 4)}
        if self.json is not None:  # strict JSON: a skipped fp16 step's inf norm becomes null
            line = strict_json(record) + "\n"
            try:
                self.json.write(line)
            except OSError as exc:
                if exc.errno in DISK_ERRORS:
                    raise self._json_lost(exc, step) from None
                with _naming(self.json_flag):
                    raise
            self.json_whole += len(line.encode())
        scalars = scalars_of(metrics)
        if self.tb is not None:
            with _naming(self.tb_flag):
                for key, value in scalars.items():
                    self.tb.add_scalar(key, value, step)
        if self.wandb is not None and step >= self.wandb_from:
            self.wandb.log(scalars, step=step)

    def _json_lost(self, exc: OSError, step: int) -> RunStopped:
        """The stop of a --log-json write the disk refused (full, read-only, over quota): the
        file cut back to its whole records, or removed where this run made it and it holds
        none (it was left empty, or with half a line); one line with the fix."""
        output, self.json = self.json, None  # (close's flush would fail again)
        if output is not None:
            try:
                output.close()
            except OSError:
                pass
        path = self.json_path
        kept = "the records before it are kept" if self.json_whole else "it holds no record"
        if os.path.isfile(path):  # a regular file (not /dev/full)
            try:
                if self.json_new and not self.json_whole:
                    os.remove(path)
                    kept = "the file it began is removed"
                else:
                    os.truncate(path, self.json_whole)
            except OSError:
                pass
        return RunStopped(
            f"{self.json_flag}: {exc.strerror} writing step {step}'s record; {kept} (free "
            f"space there, or give --log-json another file)"
        )

    def checkpoint_meta(self) -> dict:
        """The W&B run this logger writes to, {"wandb_run": {"project", "id"}}, for a checkpoint
        to record (a run resumed from it continues that run); {} without W&B."""
        if self.wandb is None:
            return {}
        return {"wandb_run": {"project": self.wandb_project, "id": self.wandb.id}}

    def close(self) -> None:
        """Close every output; the first OSError (naming its flag) is raised once all are
        closed."""
        failed: OSError | None = None
        if self.bar is not None:
            self.bar.close()
        for flag, output in ((self.json_flag, self.json), (self.tb_flag, self.tb)):
            if output is not None:
                try:
                    with _naming(flag):
                        output.close()
                except OSError as exc:
                    failed = failed or exc
        if self.wandb is not None:
            self.wandb.finish()
        if failed is not None:
            raise failed


def _quiet_tensorboard_thread() -> None:
    """Keep TensorBoard's writer thread from printing a traceback when a write fails (a full
    disk): the thread keeps the error and the writer raises it at the run's next write, where
    the run names it in one line (`_naming`); other threads' errors print as before."""
    previous = threading.excepthook
    if getattr(previous, "megapar_tensorboard", False):
        return

    def hook(args) -> None:
        thread = args.thread
        if not (
            type(thread).__name__ == "_AsyncWriterThread"
            and type(thread).__module__.startswith("tensorboard.")
            and getattr(thread, "exception", None) is args.exc_value
        ):
            previous(args)

    hook.megapar_tensorboard = True  # type: ignore[attr-defined]
    threading.excepthook = hook


class _naming:
    """Context manager: an OSError inside is raised again naming the output's flag and path
    (`--log-json run.jsonl`), which the error of a full or lost disk does not."""

    def __init__(self, flag: str):
        self.flag = flag

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, tb) -> None:
        if isinstance(exc, OSError) and self.flag not in str(exc):
            if exc.errno is None:
                raise OSError(f"{exc}: writing {self.flag}") from exc
            raise OSError(exc.errno, f"{exc.strerror}: writing {self.flag}") from exc


def perplexity(loss: float) -> float:
    """exp(`loss`), the perplexity of a mean loss, never capped: inf where it exceeds the
    largest float (a loss above 709.78), nan for a nan loss."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


def strict_json(record: dict) -> str:
    """`record` as one line of strict JSON: a float that is not finite (an inf perplexity, a
    skipped fp16 step's inf norm) is null, which every JSON reader takes (json.dumps would
    write Infinity / NaN, which are not JSON)."""
    clean = {
        k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()
    }
    return json.dumps(clean, allow_nan=False)


def scalars_of(metrics: dict) -> dict[str, float]:
    """The metrics TensorBoard and W&B plot: each number as it is, and each list of numbers (a
    mixture of experts' `moe_tokens_per_expert`) as one scalar per entry, `key/i`, which both
    show as one group of curves; anything else is left to the JSON log."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        if isinstance(value, (int, float)):
            out[key] = value
        elif isinstance(value, (list, tuple)) and all(isinstance(v, (int, float)) for v in value):
            out.update({f"{key}/{i}": v for i, v in enumerate(value)})
    return out


def format_line(step: int, m: dict, fp16: bool = False) -> str:
    """The console log line: tokens/s of the whole job, TFLOP/s per rank (per GPU: Megatron's
    TFLOP/s/GPU) and MFU; `bubble` with a pipeline, `grad-reduce wait` (the idle share of a
    step without one: waiting for the data-parallel gradient reduction) at pp 1 with dp or cp,
    neither at pp 1 alone; the output z-loss term after the loss (--z-loss); a mixture of
    experts' router statistics (the balancing losses, the busiest layer's max / mean tokens
    per expert, the share of assignments dropped); the steps skipped for inf / nan since the
    last line (`skipped_steps`, else this step's `skipped`); the loss scale the step ran with
    (every line under `fp16`, else where it is not 1); each rank named slow (`stragglers`) at
    the end."""
    parts = [
        f"step {step:>6}",
        f"loss {m['loss']:.4f}",
        *([f"z_loss {m['z_loss']:.4f}"] if "z_loss" in m else []),
        f"lr {m['lr']:.3e}",
        f"grad_norm {m['grad_norm']:.3f}",
        f"tok/s {m['tokens_per_s']:,.0f}",
        f"TFLOP/s/rank {m['tflops_per_rank']:.3f}",
        f"MFU {100 * m['mfu']:.2f}%",
    ]
    if "bubble" in m:
        parts.append(f"bubble {100 * m['bubble']:.1f}%")
    if "grad_reduce_wait" in m:
        parts.append(f"grad-reduce wait {100 * m['grad_reduce_wait']:.1f}%")
    parts.append(f"mem {m['peak_mem_mb']:,.0f} MiB")
    if "moe_aux_loss" in m:
        parts.append(
            f"moe aux {m['moe_aux_loss']:.4f} z {m['moe_z_loss']:.3f} "
            f"imbalance {m['moe_imbalance']:.2f} dropped {100 * m['moe_dropped']:.1f}%"
        )
    skipped = m.get("skipped_steps", int(bool(m.get("skipped"))))
    if skipped:
        parts.append(f"skipped {skipped} (inf/nan)")
    if m.get("no_labelled_tokens"):  # (it read as a loss of 0 and an update; a new user's)
        parts.append("no labelled token in the batch: nothing applied")
    if "loss_scale" in m and (fp16 or m["loss_scale"] != 1.0):
        parts.append(f"scale {scale_text(m['loss_scale'])}")
    parts.extend(Straggler(**s).describe() for s in m.get("stragglers", ()))
    return " | ".join(parts)
