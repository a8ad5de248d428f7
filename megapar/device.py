"""The one place where the device and the distributed backend are chosen, and
torch.distributed is started.

Everything else asks here: no `.cuda()` calls scattered around. On a machine with CUDA the
backend is NCCL and each rank uses the GPU of its local rank; otherwise gloo on the CPU. Also:
torchrun's and Slurm's environments read and checked, the rendezvous and `init_distributed`
(every wait bounded, a rank that cannot connect named), waiting on communication the way the
device needs (`wait`), and GPUs' peak rates for MFU.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import socket
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

# Before any group exists: imported later (torch imports it lazily), torch.distributed.nn's
# functions would keep the world group in their `group=group.WORLD` defaults for good, so
# `megapar.launcher.release_process_groups` could never free it.
import torch.distributed.nn  # noqa: F401

from megapar import shared_gpu
from megapar.env_seconds import TIMEOUT_ENV, env_seconds
from megapar.faults import stop
from megapar.faults.blame import JOIN_BOUND_EXIT
from megapar.faults.status import set_action
from megapar.wording import counted, first_few

#: Default timeout for every collective and point-to-point operation (seconds). A rank that
#: waits longer raises instead of hanging. Override with MEGAPAR_TIMEOUT_S.
DEFAULT_TIMEOUT_S = env_seconds(TIMEOUT_ENV["timeout_s"], 300.0)

#: Default timeout of an NCCL process group (seconds): NCCL's watchdog aborts a collective that
#: has not finished by then. It is what ends a hang on GPUs (megapar's own waits only order the
#: stream there), and it also runs while the other ranks wait in a collective for a slow
#: checkpoint save or resharding load, so it is longer than the pipeline's DEFAULT_TIMEOUT_S
#: (Megatron's --distributed-timeout-minutes, torchtitan's comm.train_timeout_seconds play the
#: same part). Override with MEGAPAR_NCCL_TIMEOUT_S or megapar-train --nccl-timeout-s.
DEFAULT_NCCL_TIMEOUT_S = env_seconds(TIMEOUT_ENV["nccl_timeout_s"], 1800.0)


def use_cuda() -> bool:
    """True when this process should run on CUDA (available and not disabled by MEGAPAR_CPU=1)."""
    return torch.cuda.is_available() and os.environ.get("MEGAPAR_CPU", "0") != "1"


def cpu_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def backend() -> str:
    """The torch.distributed backend: "nccl" with CUDA, "gloo" otherwise (and with CUDA when
    the ranks share the GPUs: `megapar.shared_gpu`)."""
    return "nccl" if use_cuda() and not shared_gpu.enabled() else "gloo"


class DeviceError(RuntimeError):
    """This process has no GPU of its own (more ranks on a node than GPUs)."""


def env_local_rank() -> int:
    """This process's rank on its node: torchrun's LOCAL_RANK, Slurm's SLURM_LOCALID, else 0."""
    return int(os.environ.get("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0")))


def device(local_rank: int | None = None) -> torch.device:
    """The device of this rank: cuda:<local_rank> with CUDA, cpu otherwise.

    A local rank without a GPU of its own is a `DeviceError` naming the fix: NCCL would
    otherwise fail later with "Duplicate GPU detected" (two ranks on one GPU). One exception:
    under Slurm's per-task GPU binding (--gpus-per-task 1) every task sees its own GPU as its
    only device, so a task whose SLURM_LOCALID is past the one visible device takes cuda:0.
    With `MEGAPAR_SHARED_GPU=1` (`megapar.shared_gpu`) local rank r takes cuda:(r mod GPUs)."""
    if not use_cuda():
        return torch.device("cpu")
    rank = env_local_rank() if local_rank is None else local_rank
    count = torch.cuda.device_count()
    if shared_gpu.enabled():  # several ranks per GPU, over gloo
        return torch.device("cuda", rank % count)
    if rank < count:
        return torch.device("cuda", rank)
    if (
        count == 1
        and "SLURM_LOCALID" in os.environ
        and "LOCAL_RANK" not in os.environ
        and os.environ.get("CUDA_VISIBLE_DEVICES")
    ):
        return torch.device("cuda", 0)  # Slurm bound this task to one GPU
    raise DeviceError(gpu_shortage(rank + 1, count))


def gpu_shortage(ranks: int, gpus: int) -> str:
    """The one-line error for `ranks` processes on a node with `gpus` GPUs."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    where = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
    return (
        f"{counted(ranks, 'rank')} on this node but {counted(gpus, 'GPU')} visible"
        f"{where}: NCCL needs a GPU per rank; start at most "
        f"{counted(gpus, 'process', 'processes')} per node (torchrun --nproc-per-node {gpus}, "
        f"launch/torchrun_multinode.sh's NPROC_PER_NODE={gpus} or slurm.sbatch's "
        f"GPUS_PER_NODE={gpus}, or a layout of tp x cp x pp x dp <= {gpus}), or set "
        f"MEGAPAR_CPU=1 to run on the CPU with gloo"
    )


def check_gpus(ranks: int) -> None:
    """`DeviceError` (one line) when `ranks` local processes would run on this node's CUDA
    devices and there are fewer GPUs than that; nothing on the CPU, nor when the ranks share
    the GPUs (`megapar.shared_gpu`). Checked before workers start."""
    if use_cuda() and not shared_gpu.enabled() and ranks > torch.cuda.device_count():
        raise DeviceError(gpu_shortage(ranks, torch.cuda.device_count()))


PEAK_TFLOPS = {  # dense TFLOP/s of one GPU by product name: (16-bit, TF32, fp32), datasheets
    "H100 PCIe": (756.0, 378.0, 51.2),
    "H100": (989.4, 494.7, 66.9),  # SXM (HBM3); NVIDIA's sparse figures are twice these
    "H200": (989.4, 494.7, 66.9),
    "A100": (312.0, 156.0, 19.5),
}
"""Peak dense matrix rates of the GPUs megapar has figures for (MFU's denominator)."""

MOST_TFLOPS = 20_000.0
"""The most TFLOP/s a --peak-tflops takes: above any GPU's dense rate (a B200's FP4 is 9,000)."""


def too_fast(tflops: float) -> str | None:
    """The refusal of a --peak-tflops above any GPU's dense peak (GFLOP/s meant: 989e3), or
    None."""
    if tflops <= MOST_TFLOPS:
        return None
    return (
        f"--peak-tflops {tflops:g} is more than any GPU's dense peak: give TFLOP/s, such as 989 "
        f"for an H100 / H200 in bf16 ({tflops:g} GFLOP/s is {tflops / 1000:g} TFLOP/s)"
    )


def bf16_peak_of(tflops: float, precision: str) -> str | None:
    """For a run in `precision` fp32, the GPU whose 16-bit dense peak `tflops` is (989 for an
    H100's 989.4: a rate 15 x its fp32 one); None otherwise (and at bf16 / fp16, where it is
    the right rate)."""
    if precision != "fp32":
        return None
    return next((n for n, rates in PEAK_TFLOPS.items() if abs(tflops - rates[0]) <= 1), None)


def peak_tflops(dev: torch.device, precision: str, tf32: bool = False) -> float | None:
    """The dense peak TFLOP/s of `dev` for a run in `precision` (bf16 / fp16: the 16-bit
    tensor-core rate; fp32: the TF32 rate with `tf32`, else plain fp32), or None where megapar
    has no figure (the CPU, other GPUs)."""
    if torch.device(dev).type != "cuda":
        return None
    name = torch.cuda.get_device_name(dev)
    for product, rates in PEAK_TFLOPS.items():
        if product in name:
            return rates[0] if precision in ("bf16", "fp16") else rates[1 if tf32 else 2]
    return None


def cuda_context_bytes(dev: torch.device) -> int:
    """Device memory this process holds outside torch's allocator: the CUDA context and the
    libraries' own (what the driver reports used, less what the allocator has reserved; other
    processes on the GPU count too, so call it where this process is alone on it)."""
    free, total = torch.cuda.mem_get_info(dev)
    return max(0, total - free - torch.cuda.memory_reserved(dev))


def polls_host(device: torch.device) -> bool:
    """Whether waiting on communication of tensors on `device` blocks the host (gloo, CPU
    tensors, or CUDA tensors when the ranks share the GPUs over gloo: `megapar.shared_gpu`)
    rather than ordering the stream (NCCL, CUDA tensors).

    Decided by the device (and that process-wide mode), not by the process group's backend
    name: a group the user made reads "undefined" or "cpu:gloo,cuda:nccl", and taking the gloo
    path on NCCL (host waits, receives posted ahead) breaks NCCL's issue order."""
    return _polls_host(device, shared_gpu.enabled())


@functools.lru_cache(maxsize=64)
def _polls_host(device, shared: bool) -> bool:
    """`polls_host`, worked out once per device (a `torch.device` or its name) and mode: a
    pipeline step asks it for every message it waits for."""
    return shared or torch.device(device).type != "cuda"


@functools.lru_cache(maxsize=64)
def _seconds(timeout_s: float) -> timedelta:
    """`timeout_s` as the timedelta a gloo `work.wait` takes, made once per value."""
    return timedelta(seconds=timeout_s)


HOST_COPIES_ENV = "MEGAPAR_HOST_COPIES"
"""Set to 1: offloading (--offload-optimizer, --offload-params) makes separate host copies
even of tensors already on the CPU, as it does of a GPU's."""


def host_copies_wanted(device: torch.device) -> bool:
    """Whether offloading tensors of `device` makes separate host copies: off the CPU, or when
    `HOST_COPIES_ENV` asks for them."""
    return torch.device(device).type != "cpu" or os.environ.get(HOST_COPIES_ENV) == "1"


def host_buffer(like: torch.Tensor) -> torch.Tensor:
    """An empty host tensor of `like`'s shape and dtype to copy it into: page-locked (pinned)
    when `like` is on a GPU, so that the copy runs asynchronously on its stream
    (`copy_(..., non_blocking=True)`) and the host need not wait for it; plain host memory
    otherwise (a CPU tensor is copied at once)."""
    return torch.empty(
        like.shape,
        dtype=like.dtype,
        pin_memory=like.device.type == "cuda" and torch.cuda.is_available(),
    )


LOST_HINT = "a peer's connection closed: that rank probably died (look for its error)"
"""The end of the error of a wait that failed before its timeout (`wait`)."""


def wait(
    work, device: torch.device, timeout_s: float, what, error: type = TimeoutError, hint: str = ""
) -> None:
    """Wait for the asynchronous collective or point-to-point `work` on tensors of `device`.

    gloo: the host waits at most `timeout_s`, then raises `error` naming `what` and the timeout;
    when gloo fails the wait before that (a peer's connection closed: it died), the error says
    after how long, and `LOST_HINT` instead of `hint` (which may suggest a longer timeout, or a
    mismatch that would hang, not close a connection). NCCL: the wait
    only orders the current CUDA stream after the work (no host blocking, no polling); a hang is
    ended by the process group's own timeout (NCCL's watchdog, set by `init_distributed` from
    the same default), and the launcher names the rank and what it was doing. `what` is the
    text, or a function that makes it (called only for the error: a wait that succeeds formats
    nothing); `hint` ends the error message (what probably went wrong, what to do)."""
    if not polls_host(device):
        work.wait()
        return
    start = time.monotonic()
    try:
        ok = work.wait(timeout=_seconds(timeout_s))
    except Exception as exc:  # gloo raises on timeout or when the peer's connection closes
        waited = time.monotonic() - start
        if waited < timeout_s and "timed out" not in str(exc).lower():  # a connection lost
            raise error(
                f"{_text(what)} did not complete: it failed after {waited:.1f} s, before its "
                f"{timeout_s:g} s timeout ({exc}); {LOST_HINT}"
            ) from exc
        raise error(f"{_text(what)} did not complete within {timeout_s:g} s ({exc}){hint}") from exc
    if ok is False:
        raise error(
            f"{_text(what)} did not complete within {timeout_s:g} s (wait() returned False){hint}"
        )


def _text(what) -> str:
    return what() if callable(what) else what


_SLURM_RANGES = re.compile(r"\d+(-\d+)?(,\d+(-\d+)?)*")


def _set_counts(names: dict[str, str | None], fix: str) -> dict[str, int]:
    """{name: value} of the environment variables `names` that are set, each a rank (0, 1,
    ...; `names[name]` None) or a count >= 1 (`names[name]`: what it counts); ValueError
    naming the first malformed one and the `fix`."""
    env, counts = os.environ, {}
    for name, unit in names.items():
        if name not in env:
            continue
        value = env[name].strip()
        if not value.isdigit() or (unit is not None and int(value) < 1):
            what = f"{unit} count (>= 1)" if unit is not None else "rank (0, 1, ...)"
            raise ValueError(f"{name}={env[name]!r} is not a {what}; {fix}")
        counts[name] = int(value)
    return counts


def check_torchrun_environment() -> None:
    """Raise ValueError (one line naming the variable and the fix) when a variable of torchrun's
    that megapar reads is malformed: RANK / LOCAL_RANK not a rank, WORLD_SIZE /
    LOCAL_WORLD_SIZE not a count, RANK not below WORLD_SIZE or LOCAL_RANK not below
    LOCAL_WORLD_SIZE (a rank that would wait out --timeout-s for peers that never come), a
    WORLD_SIZE above 1 without RANK outside srun (a stray export: the one process took it as
    its world and failed after starting)."""
    fix = "run under torchrun (which sets it), or unset it"
    counts = _set_counts(
        {"WORLD_SIZE": "process", "LOCAL_WORLD_SIZE": "process", "RANK": None, "LOCAL_RANK": None},
        fix,
    )
    stray = "RANK" not in counts and "SLURM_PROCID" not in os.environ
    if stray and counts.get("WORLD_SIZE", 1) > 1:
        raise ValueError(
            f"WORLD_SIZE={counts['WORLD_SIZE']} is set but RANK is not: each process of a "
            f"torchrun job has both; {fix} (megapar-train starts tp x cp x pp x dp workers "
            f"itself)"
        )
    for rank, size in (("RANK", "WORLD_SIZE"), ("LOCAL_RANK", "LOCAL_WORLD_SIZE")):
        if rank in counts and size in counts and counts[rank] >= counts[size]:
            ranks = f"0-{counts[size] - 1}" if counts[size] > 1 else "only 0"
            raise ValueError(
                f"{rank}={counts[rank]} is not below {size}={counts[size]} (the ranks are "
                f"{ranks}); {fix}"
            )


def check_slurm_environment() -> None:
    """Raise ValueError (one line naming the variable and the fix) when a Slurm variable that
    megapar reads is malformed: SLURM_PROCID / SLURM_LOCALID not a rank below SLURM_NTASKS,
    SLURM_NTASKS not a count, a node list with unbalanced or bad brackets. Torchrun's
    variables (RANK set) take precedence and leave SLURM_PROCID / SLURM_NTASKS unread."""
    env = os.environ
    fix = "run under srun (which sets it), or unset it"
    names = ["SLURM_LOCALID"] if "LOCAL_RANK" not in env else []
    if "RANK" not in env:
        names = ["SLURM_NTASKS", "SLURM_PROCID", *names]
    counts = _set_counts({n: "task" if n == "SLURM_NTASKS" else None for n in names}, fix)
    tasks = counts.get("SLURM_NTASKS")
    for name in ("SLURM_PROCID", "SLURM_LOCALID"):
        if tasks is not None and counts.get(name, 0) >= tasks:
            raise ValueError(
                f"{name}={counts[name]} is not below SLURM_NTASKS={tasks} (the "
                f"ranks are 0-{tasks - 1}); {fix}"
            )
    if "RANK" in env or tasks is None or tasks < 2 or "MASTER_ADDR" in env:
        return
    for name in ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"):
        if name in env:  # the one adopt_slurm_environment reads
            nodes = env[name].strip()
            brackets = re.findall(r"\[([^\[\]]*)\]", nodes)
            if (
                nodes
                and nodes.count("[") == nodes.count("]") == len(brackets)
                and all(_SLURM_RANGES.fullmatch(b) for b in brackets)
            ):
                return
            raise ValueError(
                f"{name}={env[name]!r} is not a Slurm host list (e.g. "
                f"'gpu[003-004,9],cpu1'); {fix}, or set MASTER_ADDR"
            )


def adopt_slurm_environment() -> bool:
    """Under `srun` without torchrun (one task per GPU), give torch.distributed what torchrun
    would: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE from SLURM_PROCID / SLURM_NTASKS /
    SLURM_LOCALID / SLURM_NTASKS_PER_NODE, MASTER_ADDR from the first host of the step's node
    list and MASTER_PORT from the job id (unless they are set). Does nothing under torchrun
    (RANK set) or outside a Slurm step of several tasks. Returns whether it filled them."""
    env = os.environ
    if "RANK" in env or "SLURM_PROCID" not in env or int(env.get("SLURM_NTASKS", "1")) < 2:
        return False
    env.update(
        RANK=env["SLURM_PROCID"],
        WORLD_SIZE=env["SLURM_NTASKS"],
        LOCAL_RANK=env.get("SLURM_LOCALID", "0"),
    )
    per_node = env.get("SLURM_NTASKS_PER_NODE", env.get("SLURM_TASKS_PER_NODE", ""))
    if per_node.split("(")[0].split(",")[0].isdigit():  # "4(x2)" or "4,4": 4 on this node's kind
        env.setdefault("LOCAL_WORLD_SIZE", per_node.split("(")[0].split(",")[0])
    nodes = env.get(
        "SLURM_STEP_NODELIST", env.get("SLURM_JOB_NODELIST", env.get("SLURM_NODELIST", ""))
    )
    if nodes:
        env.setdefault("MASTER_ADDR", first_host(nodes))
    job = env.get("SLURM_JOB_ID", "")
    if job.isdigit():  # two jobs sharing a node must not share a port (as Lightning does)
        env.setdefault("MASTER_PORT", str(15000 + int(job) % 20000))
    return True


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list: "gpu[003-004,9],cpu1" -> "gpu003" (what
    `scontrol show hostnames | head -1` prints)."""
    head = nodelist.strip()
    depth = 0
    for i, ch in enumerate(head):  # the first entry: up to a comma outside brackets
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            head = head[:i]
            break
    if "[" not in head:
        return head
    prefix, _, rest = head.partition("[")
    ranges, _, suffix = rest.partition("]")
    return prefix + ranges.split(",")[0].split("-")[0] + suffix


SHORT_JOIN_S = 1.0
"""A bound on joining a process group below this many seconds may be less than the members
take to connect at all: the line that it ran out says so beside a member's death."""

CONNECT_BOUND = 2.0
"""A gloo process group's creation may last this many times the wait (`--timeout-s`): the
wait for its members' addresses, which gloo bounds by the group's timeout, and as long again
for the connections. gloo itself waits up to 5 times the group's timeout for a member that
gave its address and then died or stopped (or whose address was a dead rank's: torchrun's
restarts, `default_store_prefix`; measured in docs/guides/faults.md)."""


_GLOO_CONNECT = re.compile(r"Gloo connectFullMesh failed with (?:\[[^\]]*\] )?(?P<why>.*)", re.S)
_REMOTE = re.compile(r"(?:, remote=| )?\[(?P<host>[^\]\s]+)\]:(?P<port>\d+)(?:\$\d+)?")
"""A member's address in gloo's error: [HOST]:PORT, and $N, the pair's sequence number."""


def connect_failure(error: str, what: str, rank: int, wait_s: float) -> str | None:
    """The one line for gloo's failure to connect to a member of a group (`error`: its
    "Gloo connectFullMesh failed with ... remote=[HOST]:PORT"), raised at once where the
    address a member gave in the store refuses the connection (the member is gone: it died, or
    the address is an earlier job's or attempt's) or cannot be reached; None for any other
    error. `what`: what the rank was doing ("joining the process group")."""
    found = _GLOO_CONNECT.search(error)
    if not found:
        return None
    why = found.group("why").strip().splitlines()[0] if found.group("why").strip() else ""
    remote = _REMOTE.search(why)
    where = f"{remote.group('host')}:{remote.group('port')}" if remote else "its address"
    why = _REMOTE.sub("", why).split(". ")[0].strip(" ,;.") or "no reason given"
    return (
        f"rank {rank} could not connect to a member of its group at {where} while {what} "
        f"(gloo: {why}): check that every rank has the same MASTER_ADDR / MASTER_PORT (else "
        f"it reads another job's or an earlier attempt's addresses) and that the node at "
        f"{where.rsplit(':', 1)[0]} is up and reachable from this one; --timeout-s "
        f"({wait_s:g} s) bounds how long the members may take to join"
    )


@contextlib.contextmanager
def connect_bound(what: str, wait_s: float, rank: int):
    """Around the creation of a gloo process group (`what`, e.g. "joining the process group"):
    if it has not returned `CONNECT_BOUND` x `wait_s` after it began, the rank writes one line
    (what, how long, --timeout-s), runs the forced-exit cleanups (its --save lock) and exits
    with code `JOIN_BOUND_EXIT`, which a wait inside gloo cannot see otherwise. A connection
    gloo gives up on at once (a member's address refuses it) is a ConnectionError in one line
    (`connect_failure`) instead of gloo's. Nothing on NCCL."""
    if backend() == "nccl":
        yield
        return
    done = threading.Event()

    def watch() -> None:
        if done.wait(CONNECT_BOUND * wait_s):
            return
        cleaned = stop.run_forced_exit_cleanups()
        stop.write_block(
            f"megapar: rank {rank}: {what} did not complete in {CONNECT_BOUND * wait_s:g} s "
            f"({CONNECT_BOUND:g} x --timeout-s {wait_s:g}): a member gave its address and "
            f"then did not connect (it died or stopped)"
            + (
                f", or {CONNECT_BOUND * wait_s:g} s is too short to connect them: raise --timeout-s"
                if CONNECT_BOUND * wait_s < SHORT_JOIN_S
                else ""
            )
            + f"; exiting with code {JOIN_BOUND_EXIT}"
            + "".join(f"; {d}" for d in cleaned)
        )
        os._exit(JOIN_BOUND_EXIT)

    threading.Thread(target=watch, name="megapar-connect-bound", daemon=True).start()
    try:
        yield
    except RuntimeError as exc:
        line = connect_failure(str(exc), what, rank, wait_s)
        if line is None:
            raise
        raise ConnectionError(line) from None
    finally:
        done.set()


def group_timeout_s(name: str, timeout_s: float, nccl_timeout_s: float | None = None) -> float:
    """The timeout of the process groups of backend `name`: gloo's is megapar's wait
    (`timeout_s`); NCCL's is its watchdog's, `nccl_timeout_s` (default
    DEFAULT_NCCL_TIMEOUT_S), never shorter than the wait."""
    if name != "nccl":
        return timeout_s
    return max(timeout_s, nccl_timeout_s or DEFAULT_NCCL_TIMEOUT_S)


def process_group_timeout_s(group=None) -> float | None:
    """The timeout of process group `group` (default: the world group) in seconds, as its
    backend holds it (gloo's or NCCL's options), or None where torch does not tell."""
    try:
        pg = group if group is not None else dist.distributed_c10d._get_default_group()
        dev = torch.device("cuda" if backend() == "nccl" else "cpu")
        return pg._get_backend(dev).options._timeout.total_seconds()
    except (AttributeError, RuntimeError, ValueError):
        return None


def bound_world_waits(timeout_s: float) -> None:
    """Make the world group's waits last at most `timeout_s` on gloo, as the mesh's groups
    do (`megapar.prepare`'s timeout_s: the world was set up by the launcher or torchrun with
    its own, and a step's batch check and stop flags are world collectives). NCCL's world
    group keeps its watchdog's timeout (`--nccl-timeout-s`)."""
    if not dist.is_initialized() or backend() == "nccl":
        return
    if process_group_timeout_s() != timeout_s:
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=timeout_s))


ARRIVED_KEY = "megapar/arrived"
"""The rendezvous store's key prefix of the ranks that reached it (`_never_arrived`)."""


def _never_arrived(store, world_size: int, said: str, first: int = 0) -> str:
    """The ranks from `first` on whose key under `ARRIVED_KEY` is not in `store` ("ranks 2,
    3"; `first` 1 where rank 0 holds the store, so is there); without a store (torch's
    rendezvous itself timed out: `said`, "1/2 clients joined") how many; "" where neither can
    say (the store is gone, or every rank arrived and a later wait failed)."""
    if store is None:
        counted = re.search(r"(\d+)/(\d+) clients joined", said)
        if counted is None:
            return ""
        came, all_ = int(counted.group(1)), int(counted.group(2))
        return f"{all_ - came} of the {all_}"
    try:
        absent = [r for r in range(first, world_size) if not store.check([f"{ARRIVED_KEY}/{r}"])]
    except Exception:  # noqa: BLE001 - the store itself failed: say nothing of the ranks
        return ""
    if not absent:
        return ""
    return f"rank{'s' if len(absent) > 1 else ''} {first_few([str(r) for r in absent], 8)}"


JOINED_KEY = "megapar/joined"
"""The rendezvous store's count of the ranks whose process group is connected (`_all_joined`)."""


def _all_joined(store, world_size: int, wait_s: float) -> None:
    """Return once every rank's `init_process_group` has returned (each counts itself in
    `store`; DistStoreError after `wait_s`), so that no rank, its function done at once (no
    collective), closes its sockets while another is still inside gloo's connect, which fails
    then with "Connection closed by peer" (docs/guides/faults.md). A default group set up
    again on the same keys (torchrun's store, after ``destroy_process_group``) counts on: its
    ranks wait for their own round's key."""
    joined = store.add(JOINED_KEY, 1)
    round_key = f"{JOINED_KEY}/all_{(joined - 1) // world_size}"
    if joined % world_size == 0:
        store.set(round_key, "1")
    store.wait([round_key], timedelta(seconds=wait_s))


WAITING_NOTICE_S = 15.0
"""Seconds a rank waits for the others to join before it says once that it is waiting."""


def waiting_notice(rank: int, world_size: int, wait_s: float) -> threading.Event:
    """An event to set once this rank's join of the default process group returns: if it is
    not set within `WAITING_NOTICE_S` (and the wait is longer), the rank says once on stderr
    whom it waits for, where and how long it will, instead of staying silent up to `wait_s` (a
    rank started before the others, or started alone with RANK / WORLD_SIZE set)."""
    done = threading.Event()
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    where = f" at MASTER_ADDR:MASTER_PORT = {addr}:{port}" if addr and port else ""

    def watch() -> None:
        if done.wait(WAITING_NOTICE_S):
            return
        stop.write_block(
            f"megapar: rank {rank} has waited {WAITING_NOTICE_S:g} s for all {world_size} ranks "
            f"to join{where}; it waits up to {wait_s:g} s (--timeout-s) and then stops"
        )

    if world_size > 1 and wait_s > WAITING_NOTICE_S:
        threading.Thread(target=watch, name="megapar-waiting-notice", daemon=True).start()
    return done


STORE_FIX = (
    "give every rank the same MASTER_ADDR and MASTER_PORT (under srun the job's; under "
    "torchrun the --master-addr / --master-port of node 0) and start rank 0's node"
)
"""The fix a rank that cannot reach the rendezvous store is told."""


def _wait_for_store(rank: int, addr: str, port: int, wait_s: float) -> None:
    """Return once something accepts a TCP connection at `addr`:`port` (rank 0's rendezvous
    store); raise TimeoutError naming the rank, the address and the fix after `wait_s`.
    torch's own client retries with a C++ stack trace on stderr per try and fails after about
    twice its timeout, naming only the socket."""
    deadline = time.monotonic() + wait_s
    problem: OSError | None = None
    while True:
        left = deadline - time.monotonic()
        try:
            socket.create_connection((addr, port), timeout=max(0.1, min(1.0, left))).close()
            return
        except OSError as exc:
            problem = exc
        if left <= 0:
            break
        time.sleep(min(0.2, max(0.0, left)))
    why = (
        f"the name does not resolve ({problem})"
        if isinstance(problem, socket.gaierror)
        else "nothing listens there (rank 0 not started, or a different MASTER_ADDR / "
        "MASTER_PORT there?)"
    )
    raise TimeoutError(
        f"rank {rank} could not reach the rendezvous store at MASTER_ADDR:MASTER_PORT = "
        f"{addr}:{port} in {wait_s:g} s: {why}; {STORE_FIX}; --timeout-s sets the wait"
    )


def _master_port() -> int:
    """MASTER_PORT as a port number; ValueError in one line otherwise."""
    value = os.environ["MASTER_PORT"].strip()
    if not value.isdigit() or not 0 < int(value) < 65536:
        raise ValueError(
            f"MASTER_PORT={os.environ['MASTER_PORT']!r} is not a TCP port (1-65535); "
            f"give every rank the same free port"
        )
    return int(value)


def default_store_prefix() -> str:
    """The prefix of the default process group's keys in the env:// rendezvous store: one per
    torchrun attempt (TORCHELASTIC_RESTART_COUNT). torchrun's static rendezvous (--master-addr /
    --master-port) keeps one store for every restart of `--max-restarts`, so a restart's ranks
    would read the keys of the attempt before: gloo's addresses of the dead ranks (its connect
    fails, or hangs), megapar's settings comparison already done."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    return f"default_pg/attempt_{attempt}" if attempt else "default_pg"


class LaunchStore:
    """The rendezvous store of this process's `megapar.launch` rank (`keep`: its worker sets
    it before its function runs; None elsewhere). A default group set up again inside that
    function, after ``torch.distributed.destroy_process_group()``, joins on it (its rank 0
    still serves it on MASTER_PORT), under a new key prefix each time (`again`): the keys of
    the groups before are still there."""

    store = None
    joins = 0

    @classmethod
    def keep(cls, store) -> None:
        cls.store, cls.joins = store, 0

    @classmethod
    def again(cls):
        """The launch's store for the next default group, or None outside a launch's rank."""
        if cls.store is None:
            return None
        cls.joins += 1
        return dist.PrefixStore(f"megapar/again_{cls.joins}", cls.store)


def init_distributed(
    rank: int | None = None,
    world_size: int | None = None,
    timeout_s: float | None = None,
    store=None,
    nccl_timeout_s: float | None = None,
) -> None:
    """Initialise the default process group from the environment (torchrun / Slurm / our launcher).

    `store`: a rendezvous store to use instead of MASTER_ADDR / MASTER_PORT (the launcher's
    loopback-only store; in a `megapar.launch` rank whose group was destroyed, that store
    again: `LaunchStore`). With either store no rank returns before every rank's group is
    connected (`_all_joined`), so that a rank whose work is done at once cannot break a slow
    rank's join. Does nothing when the default group is already initialised. Every
    rank waits at most `timeout_s` for the others to join; a rank that never arrives makes the
    others fail with a TimeoutError naming this rank instead of hanging forever. Later
    collectives inherit `timeout_s` on gloo and `nccl_timeout_s` (default
    DEFAULT_NCCL_TIMEOUT_S) on NCCL, whose watchdog must outlast a checkpoint save.
    """

    if dist.is_initialized():
        return
    if store is None:
        store = LaunchStore.again()
    adopt_slurm_environment()
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    dev = device()
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    wait = timeout_s or DEFAULT_TIMEOUT_S
    groups = group_timeout_s(backend(), wait, nccl_timeout_s)
    set_action(
        f"joining the process group (all {world_size} ranks, bounded by --timeout-s {wait:g})"
    )
    # the launcher's own workers are watched by it; a rank of torchrun's or srun's waits alone
    joined = waiting_notice(rank, world_size, wait) if store is None else threading.Event()
    # env:// outside torchrun: rank 0's process holds the store, and waits in its own
    # rendezvous for every client (setting no key): a store that answers is rank 0 there
    rank0_store = store is None and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    try:
        if store is None:  # torch's env:// rendezvous, waiting `wait`, not the groups' timeout
            addr, port = os.environ["MASTER_ADDR"], _master_port()
            if rank != 0:
                _wait_for_store(rank, addr, port, wait)
            store, _, _ = next(
                dist.rendezvous("env://", rank, world_size, timeout=timedelta(seconds=wait))
            )
            store = dist.PrefixStore(default_store_prefix(), store)
        store.set(f"{ARRIVED_KEY}/{rank}", "1")  # for a rank that waits in vain to name the rest
        with connect_bound("joining the process group", wait, rank):
            dist.init_process_group(
                backend=backend(),
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=groups),
                store=store,
            )
        if world_size > 1:  # every rank leaves the join together (a launcher's or torchrun's)
            _all_joined(store, world_size, wait)
    except dist.DistStoreError as exc:  # the store's own words name only keys
        absent = _never_arrived(store, world_size, str(exc), 1 if rank0_store else 0)
        raise TimeoutError(
            f"rank {rank} waited {wait:g} s for all {world_size} ranks to join the process "
            f"group; {absent or 'some'} never did (a process that was refused, crashed or "
            f"never started). "
            f"Under torchrun / Slurm give every node the same command and let each reach "
            f"MASTER_ADDR:MASTER_PORT; --timeout-s sets the wait ({exc})"
        ) from None
    except dist.DistNetworkError as exc:  # torch's words name a socket, not the setting
        where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if rank == 0 and "EADDRINUSE" in first:
            raise ConnectionError(
                f"rank 0 could not open the rendezvous store at MASTER_ADDR:MASTER_PORT = "
                f"{where}: the port is in use on this host (another job, or a run still "
                f"ending?); give every rank the same free MASTER_PORT"
            ) from None
        raise ConnectionError(
            f"rank {rank} could not use the rendezvous store at MASTER_ADDR:MASTER_PORT = "
            f"{where} ({first}); {STORE_FIX}"
        ) from None
    finally:
        joined.set()
    if shared_gpu.enabled():
        shared_gpu.install()  # gloo gets CUDA tensors only where it has a CUDA path
    set_action("setting up after joining the process group")
