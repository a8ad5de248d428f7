import math
import os
import sys
import time

import pytest
import torch
import torch.distributed as dist
from forked import join_or_kill

from megapar.launcher import WorkerError, run_local


def _sum_ranks():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return t.item()


def _rank2_raises():
    if dist.get_rank() == 2:
        raise ValueError("boom on purpose")
    t = torch.zeros(1)
    dist.all_reduce(t)  # the others block here until the parent brings them down
    return 0


def test_collective_on_8_ranks():
    assert run_local(_sum_ranks, 8) == [28.0] * 8


def test_failing_rank_is_named_and_nobody_hangs():
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"rank 2 failed: ValueError: boom on purpose"):
        run_local(_rank2_raises, 4, timeout_s=60)
    assert time.monotonic() - start < 30


def test_the_workers_end_under_the_forwarding_handlers(monkeypatch):
    """A second Ctrl-C while the launcher reaped its workers after their results met Python's
    own handler again: a bare KeyboardInterrupt, which megapar-train called "SIGINT while
    starting" at step 4. The launcher's handlers stay until every worker is joined."""
    import multiprocessing.process
    import signal

    seen = []
    join = multiprocessing.process.BaseProcess.join

    def watched(self, timeout=None):
        seen.append(signal.getsignal(signal.SIGINT))
        return join(self, timeout)

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "join", watched)
    assert run_local(_sum_ranks, 2) == [1.0, 1.0]
    assert len(seen) >= 2 and signal.default_int_handler not in seen, seen
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


_JOINED_AT = []
"""When this (forked) rank's init_process_group returned (`_slow_join`)."""


def _slow_join(monkeypatch, slow_rank: int) -> None:
    """Patch init_process_group so that rank `slow_rank` takes 0.5 s more to return from it
    (after gloo connected), each rank recording when it returned in `_JOINED_AT`."""
    real = dist.init_process_group

    def slow_join(*args, **kwargs):
        real(*args, **kwargs)
        if kwargs["rank"] == slow_rank:
            time.sleep(0.5)
        _JOINED_AT.append(time.monotonic())

    monkeypatch.setattr(dist, "init_process_group", slow_join)


def _started_at():
    """A function with no collective: it returns at once (and the rank tears its group down)."""
    return _JOINED_AT[0], time.monotonic()


def test_no_local_rank_starts_before_every_rank_has_joined(monkeypatch):
    """Rank 0 slow between gloo connecting its pair and returning from init_process_group (the
    window where heavy load once failed it with "Gloo connectFullMesh failed ... Connection
    closed by peer": rank 1, finished at once, had closed its socket). Rank 1's function now
    starts only after rank 0 has joined; it started 0.5 s before."""
    _slow_join(monkeypatch, 0)
    (joined_0, _), (_, started_1) = run_local(_started_at, 2, optimizers=False)
    assert started_1 >= joined_0, (joined_0, started_1)


def test_no_torchrun_rank_starts_before_every_rank_has_joined(monkeypatch):
    """The same under torchrun's environment (the env:// rendezvous, no launcher's store), rank 1
    slow to join: rank 0, with nothing to do, returned and tore its group down while rank 1 was
    still joining (test_faults' shared log directory test failed once with "Connection closed
    by peer"). Rank 0's function started 0.5 s before rank 1 had joined."""
    from megapar.launcher import run_workers

    _slow_join(monkeypatch, 1)
    [(_, started_0)], [(joined_1, _)] = _run_as_torchrun(
        lambda: run_workers(_started_at, 2, collective_timeout_s=30), 2)
    assert started_0 >= joined_1, (started_0, joined_1)


def test_launch_refuses_more_processes_than_the_machine_runs_unless_told(monkeypatch):
    """megapar.launch(fn, 64) forked 64 processes on 2 cores: refused before any starts, the
    limit and the way around it named; oversubscribe=True starts them."""
    import megapar
    from megapar import launcher

    started = []
    monkeypatch.setattr(launcher, "run_local", lambda fn, n, *a, **k: started.append(n) or [n])
    too_many = launcher.local_worker_limit() + 1
    with pytest.raises(ValueError, match=rf"megapar.launch\(fn, {too_many}\) starts {too_many} "
                                         rf"local worker processes, more than this machine runs "
                                         rf"well .* or pass oversubscribe=True"):
        megapar.launch(print, too_many)
    assert not started
    assert megapar.launch(print, too_many, oversubscribe=True) == too_many == started[0]


def test_launch_refuses_a_non_callable_fn_or_a_non_int_nprocs_before_any_worker_starts(
        monkeypatch):
    """megapar.launch(42, 2) forked two workers that each failed 'int object is not callable';
    a wrong fn or nprocs is now a TypeError in the caller, no worker started."""
    import megapar
    from megapar import launcher

    started = []
    monkeypatch.setattr(launcher, "run_local", lambda fn, n, *a, **k: started.append(n) or [n])
    with pytest.raises(TypeError, match=r"fn must be a function to run on every rank, got int 42"):
        megapar.launch(42, 2)
    with pytest.raises(TypeError, match=r"nprocs must be an int, got str '2'"):
        megapar.launch(print, "2")
    with pytest.raises(TypeError, match=r"nprocs must be an int, got float 2.0"):
        megapar.launch(print, 2.0)
    assert not started
    assert megapar.launch(print, 2) == 2 == started[0]


def _group_and_rank(fail: bool = False):
    import torch.distributed as dist

    if fail:
        raise RuntimeError("boom")
    return dist.is_initialized() and (dist.get_rank(), dist.get_world_size())


def test_launch_of_one_rank_keeps_the_contract_of_many():
    """megapar.launch(fn, 1) called fn in the launching process: no process group (fn's
    dist.get_rank() failed only there), its exception raised as it was, not a WorkerError
    naming the rank, and timeout_s ignored."""
    import megapar

    assert megapar.launch(_group_and_rank, 1) == (0, 1)
    assert megapar.launch(_group_and_rank, 2) == (0, 2)
    with pytest.raises(megapar.WorkerError, match="rank 0 failed: RuntimeError: boom"):
        megapar.launch(_group_and_rank, 1, True)


def _as_torchrun_rank(rank, world, port, out, body, launcher="torchrun"):
    """Rank `rank` of a `world`-rank torchrun job (torchrun's environment, not torchrun), or
    with launcher="srun" of an srun step without torchrun (Slurm's variables only): reports
    (rank, body())."""
    import os

    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        os.environ.pop(name, None)
    os.environ["OMP_NUM_THREADS"] = "1"
    if launcher == "srun":
        os.environ.update(SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank),
                          SLURM_NTASKS=str(world), SLURM_NTASKS_PER_NODE=str(world),
                          SLURM_STEP_NODELIST="localhost", MASTER_PORT=str(port))
    else:
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                          LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
    out.put((rank, body()))


def _run_as_torchrun(body, world: int, launcher: str = "torchrun") -> list:
    """`body()` on `world` forked ranks with torchrun's (or srun's) environment; their results
    by rank. Every rank must exit 0."""
    import multiprocessing as mp

    from megapar.launcher import free_port

    ctx = mp.get_context("fork")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_as_torchrun_rank, args=(r, world, port, out, body, launcher))
             for r in range(world)]
    results = _results_by_rank(procs, out, 120)
    assert [p.exitcode for p in procs] == [0] * world
    return [results[r] for r in range(world)]


def _results_by_rank(procs, out, timeout_s: float) -> dict:
    """Start the forked ranks `procs`, each putting one (rank, result) on `out`; their results
    by rank once every one has put its own (within `timeout_s`), the processes then joined
    (killed after 30 s)."""
    for p in procs:
        p.start()
    try:
        return dict(out.get(timeout=timeout_s) for _ in procs)
    finally:
        join_or_kill(procs, 30)


@pytest.mark.parametrize("preinit", [False, True])
def test_torchrun_rank_destroys_only_the_group_it_made(preinit):
    """Under torchrun a rank that exits with its gloo group alive can abort in the interpreter's
    teardown ("terminate called without an active exception", SIGABRT): the group made for
    the run is destroyed when it returns; a group the caller made is left to the caller."""
    from megapar.launcher import run_workers

    def body():
        if preinit:
            dist.init_process_group("gloo", rank=0, world_size=1)
        [inside] = run_workers(dist.is_initialized, 1)
        return inside, dist.is_initialized()

    assert _run_as_torchrun(body, 1) == [(True, preinit)]


def _gloo_threads() -> int:
    import os

    names = []
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return sum(n.startswith(("pt_gloo", "gloo_")) for n in names)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")
@pytest.mark.parametrize("layout", [[], ["--zero", "1"], ["--tp", "2"], ["--pp", "2"],
                                    ["--cp", "2"]], ids=["dp2", "dp2-zero1", "tp2", "pp2", "cp2"])
def test_a_torchrun_rank_of_megapar_train_ends_with_no_gloo_thread_left(tmp_path, layout):
    """The gloo threads of every group (world, tp, dp, ...) are joined before main returns, so
    none is left for the interpreter's exit to abort on. At dp=2 the gradient hooks on the
    parameters must not keep the dp group alive."""
    from pathlib import Path

    from megapar.cli.train import main
    from megapar.data import asset_path

    text = tmp_path / "sample.txt"
    text.write_text(Path(asset_path("shakespeare_sample.txt")).read_text()[:20_000])
    argv = ["--model", "gpt2-tiny", "--data", str(text), "--tokenizer", "sentencepiece",
            "--data-cache", str(tmp_path / "cache"), "--max-steps", "2", "--seq-len", "32",
            "--micro-batch-size", "2", "--global-batch-size", "8", "--eval-interval", "0",
            "--warmup-steps", "0", "--no-progress", *layout]
    # (exit code, gloo threads left) of each rank
    assert _run_as_torchrun(lambda: (main(argv), _gloo_threads()), 2) == [(0, 0)] * 2


def _api_train():
    from transformers import GPT2Config, GPT2LMHeadModel

    import megapar

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                       vocab_size=128))
    engine = megapar.prepare(model, micro_batch_size=2, lr=1e-3)  # dp = 2
    ids = torch.randint(0, 128, (4, 17), generator=torch.Generator().manual_seed(0))
    return float(engine.train_step({"input_ids": ids[:, :-1], "labels": ids[:, 1:]}))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc")
def test_megapar_launch_under_torchrun_ends_with_no_gloo_thread_left():
    """The same for a user's script: once `launch` returns, the engine `fn` made is gone and
    with it every group's threads."""
    import megapar

    def body():
        return math.isfinite(megapar.launch(_api_train, 2)), _gloo_threads()

    assert _run_as_torchrun(body, 2) == [(True, 0)] * 2


def _join_alone(port, out, rendezvous, wait_s):
    """Rank 0 of 2 alone, waiting `wait_s`: through the launcher's own store, or torch's env://
    rendezvous (torchrun, srun) that init_distributed makes itself."""
    import os
    from datetime import timedelta

    from megapar import device

    store = None
    if rendezvous == "store":
        store = dist.TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=1),
                              wait_for_workers=False)
    else:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        device.init_distributed(rank=0, world_size=2, timeout_s=wait_s, store=store)
        out.put("joined")
    except Exception as exc:  # noqa: BLE001 - the message is the test
        out.put(f"{type(exc).__name__}: {exc}")


@pytest.mark.parametrize("rendezvous, wait_s", [("store", 1), ("env", 0.5)])
def test_a_rank_that_never_joins_is_named_in_words_not_store_keys(rendezvous, wait_s):
    """A node started with other flags exits at once; the others used to report only
    'DistStoreError: wait timeout after 30000ms, keys: /default_pg/0//cpu//0/2'. The env://
    rendezvous waits --timeout-s too, not NCCL's longer watchdog timeout. A wait under a
    second is said as it is (it read "waited 0 s"). The ranks that never reached the store are
    named (every rank marks its arrival there; "some never did" until 2026-12-04)."""
    import multiprocessing as mp

    from megapar.launcher import free_port

    ctx = mp.get_context("fork")
    out = ctx.Queue()
    p = ctx.Process(target=_join_alone, args=(free_port(), out, rendezvous, wait_s))
    p.start()
    message = out.get(timeout=60)
    p.join(timeout=30)
    absent = "rank 1" if rendezvous == "store" else "1 of the 2"  # torch's store: a count
    assert message.startswith(f"TimeoutError: rank 0 waited {wait_s:g} s for all 2 ranks to "
                              f"join the process group; {absent} never did"), message
    assert "give every node the same command" in message and "--timeout-s" in message


def _join_by_hand(port, out, rank, wait_s):
    """Rank `rank` of 3 started by hand (RANK / WORLD_SIZE / MASTER_* as a Slurm script sets
    them, no torchrun): rank 0's process holds the env:// store."""
    from megapar import device

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    try:
        device.init_distributed(rank=rank, world_size=3, timeout_s=wait_s)
        out.put((rank, "joined"))
    except Exception as exc:  # noqa: BLE001 - the message is the test
        out.put((rank, f"{type(exc).__name__}: {exc}"))


def test_ranks_started_by_hand_name_only_the_rank_that_never_came():
    """Ranks 0 and 1 of 3 started by hand, rank 2 never: rank 1 said "ranks 0, 2 never did",
    though rank 0 was there (its process holds the store and waits in torch's rendezvous, so
    it marks no arrival); rank 0 itself can only count."""
    import multiprocessing as mp

    from megapar.launcher import free_port

    ctx, port = mp.get_context("fork"), free_port()
    out = ctx.Queue()
    procs = [ctx.Process(target=_join_by_hand, args=(port, out, r, 3)) for r in (0, 1)]
    for p in procs:
        p.start()
    said = dict(out.get(timeout=90) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    assert "; rank 2 never did" in said[1], said[1]
    assert "; 1 of the 3 never did" in said[0], said[0]


class _LateReader:
    """A store whose `check` runs 2 s late: a rank that reads the difference after rank 0, which
    hosts the store, has read it too."""

    def __init__(self, store):
        self.store = store

    def __getattr__(self, name):
        return getattr(self.store, name)

    def check(self, keys):
        time.sleep(2.0)
        return self.store.check(keys)


def _compare_settings(same, late=False, uneven=False):
    """This rank's `check_same_settings` of a --tp that is rank 0's (`same`) or its own rank;
    rank 1 reading the result late (`late`); each rank's node started with rank + 1 processes
    (`uneven`)."""
    import os

    from megapar.launcher import check_same_settings

    if uneven:
        os.environ["LOCAL_WORLD_SIZE"] = str(dist.get_rank() + 1)
    settings = {"--tp": 2 if same else dist.get_rank() + 1, "--model": "gpt2-tiny"}
    if late and dist.get_rank() == 1:
        store = dist.distributed_c10d._get_default_store()
        dist.distributed_c10d._get_default_store = lambda: _LateReader(store)
    try:
        check_same_settings(settings, 10, "megapar-train flags")
        return "same"
    except ValueError as exc:
        return str(exc)


@pytest.mark.parametrize("same, late", [(True, False), (False, False), (False, True)])
def test_nodes_started_with_other_flags_are_named_on_every_rank(same, late):
    """Two ranks started with --tp 2 and --dp 2 (world 2 both): rank 0 failed with
    'DistStoreError: wait timeout after 10000ms, keys: /default_pg/0//7//cpu//0/1' (a group
    only it made) and rank 1 with gloo's 'Connection closed by peer'. Every rank now names the
    rank, the flag and both values; also one that reads them after rank 0, which hosts the
    store under srun, has (it got 'Connection reset by peer' on a loaded CI machine)."""
    from megapar.launcher import run_workers

    def body():
        return run_workers(_compare_settings, 2, same, late)[0]

    got = _run_as_torchrun(body, 2, "srun")
    if same:
        assert got == ["same", "same"]
    else:
        line = ("rank 1 was started with other megapar-train flags than rank 0: --tp 1 on rank 0 "
                "but 2 on rank 1; give every node the same megapar-train flags")
        assert got == [line, line]


def test_nodes_started_with_other_process_counts_are_named_on_every_rank():
    """NNODES=2 with NPROC_PER_NODE 1 on node 0 and 2 on node 1 trained as dp 3 "on 3 nodes of
    1 rank" (a launch-script tryout): the counts differ, so the job is not the one planned;
    every rank names the node's count, before any flag."""
    from megapar.launcher import run_workers

    def body():
        return run_workers(_compare_settings, 2, False, False, True)[0]

    line = ("rank 1's node started 2 processes where rank 0's started 1, so the job has 2 ranks "
            "on nodes of unequal size; start every node with the same count (torchrun "
            "--nproc-per-node, launch/torchrun_multinode.sh's NPROC_PER_NODE, srun's tasks per "
            "node)")
    assert _run_as_torchrun(body, 2, "srun") == [line, line]


def test_a_settings_comparison_that_times_out_says_its_wait_as_it_is(monkeypatch):
    """A rank whose peers never compared their settings within a --timeout-s under a second
    said "waited 0 s"."""
    from megapar import launcher

    class NoPeers:  # rank 0's store: the other rank never counts itself
        def set(self, key, value):
            pass

        def add(self, key, n):
            return 1

        def wait(self, keys, timeout):
            raise dist.DistStoreError("wait timeout")

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", NoPeers)
    with pytest.raises(TimeoutError, match=r"^rank 0 waited 0.5 s for all 2 ranks to compare "):
        launcher.check_same_settings({"--tp": 1}, 0.5)


def _join_unreachable(port, out, rank, timeout_s=None):
    """Rank `rank` of 2 through torch's env:// rendezvous (srun, a wrong MASTER_PORT): rank 1
    with nothing at MASTER_PORT, rank 0 with the port taken by another listener."""
    import os
    import socket

    from megapar import device

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    taken = socket.create_server(("", port)) if rank == 0 else None
    start = time.monotonic()
    try:
        wait = timeout_s or (0.5 if rank else 1)
        device.init_distributed(rank=rank, world_size=2, timeout_s=wait)
        out.put(("joined", 0.0))
    except Exception as exc:  # noqa: BLE001 - the message is the test
        out.put((f"{type(exc).__name__}: {exc}", time.monotonic() - start))
    finally:
        if taken is not None:
            taken.close()


@pytest.mark.parametrize("rank", [1, 0])
def test_a_rank_that_cannot_use_master_port_says_so_in_words(rank, capfd):
    """Rank 1 found nothing at MASTER_ADDR:MASTER_PORT: torch's client printed a C++ stack
    trace per try on stderr and failed after two tries of --timeout-s with only
    'DistNetworkError: The client socket has timed out ... (localhost, 19323)'; rank 0 with
    the port taken said only EADDRINUSE. Each now names the rank, the address and the fix."""
    import multiprocessing as mp

    from megapar.launcher import free_port

    out, port = mp.get_context("fork").Queue(), free_port()
    p = mp.get_context("fork").Process(target=_join_unreachable, args=(port, out, rank))
    p.start()
    message, took = out.get(timeout=60)
    p.join(timeout=30)
    if rank == 1:  # its wait, 0.5 s, said as it is (it read "in 0 s")
        assert message.startswith(f"TimeoutError: rank 1 could not reach the rendezvous store "
                                  f"at MASTER_ADDR:MASTER_PORT = 127.0.0.1:{port} in 0.5 s: "
                                  f"nothing listens there"), message
        assert "nothing listens there" in message and "--timeout-s" in message, message
        assert took < 3, took
        assert "Exception raised from" not in capfd.readouterr().err
    else:
        assert message.startswith("ConnectionError: rank 0 could not open the rendezvous "
                                  "store at MASTER_ADDR:MASTER_PORT = 127.0.0.1:"), message
        assert "the port is in use on this host" in message, message
    assert "give every rank the same" in message, message


def _wait_alone(port: int, out, notice_s: float) -> None:
    """Rank 1 of 2 whose rank 0 never starts, saying it waits after `notice_s`."""
    from megapar import device

    device.WAITING_NOTICE_S = notice_s
    _join_unreachable(port, out, 1, timeout_s=1.5)


@pytest.mark.parametrize("notice_s", [0.3, 5.0])
def test_a_rank_waiting_for_the_others_says_so_once_instead_of_staying_silent(notice_s, capfd):
    """`RANK=1 WORLD_SIZE=2 megapar-train` outside torchrun waited the whole --timeout-s
    (300 s by default) without a word. It now says once, after WAITING_NOTICE_S, whom it
    waits for, where and for how long; a join that ends sooner says nothing."""
    import multiprocessing as mp

    from megapar.launcher import free_port

    out, port = mp.get_context("fork").Queue(), free_port()
    p = mp.get_context("fork").Process(target=_wait_alone, args=(port, out, notice_s))
    p.start()
    message, _ = out.get(timeout=60)
    p.join(timeout=30)
    assert message.startswith("TimeoutError: rank 1 could not reach"), message
    said = [line for line in capfd.readouterr().err.splitlines() if "has waited" in line]
    if notice_s < 1.5:
        assert said == [f"megapar: rank 1 has waited 0.3 s for all 2 ranks to join at "
                        f"MASTER_ADDR:MASTER_PORT = 127.0.0.1:{port}; it waits up to 1.5 s "
                        f"(--timeout-s) and then stops"], said
    else:
        assert said == [], said


def _listening() -> list[str]:
    """The addresses this process's TCP sockets listen on (after a collective: gloo's pairs)."""
    t = torch.ones(4)
    dist.all_reduce(t)
    import os

    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    out = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                    out.append(fields[1].split(":")[0][:width])
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/net/tcp: Linux")
def test_a_local_run_listens_on_loopback_only_whatever_gloo_socket_ifname_says(monkeypatch):
    """GLOO_SOCKET_IFNAME preset to an external interface (a cluster's profile): a local run's
    gloo sockets and store still listen on 127.0.0.1 only."""
    import os

    from pathlib import Path

    external = [p.name for p in sorted(Path("/sys/class/net").iterdir()) if p.name != "lo" and
                (p / "operstate").exists() and (p / "operstate").read_text().strip() == "up"]
    if not external:
        pytest.skip("no external network interface up")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", external[0])
    for rank, addresses in enumerate(run_local(_listening, 2, timeout_s=60)):
        assert addresses, rank
        # 0100007F: 127.0.0.1 in /proc/net/tcp's byte order (IPv6: ::ffff:127.0.0.1 / ::1)
        assert all(a in ("0100007F", "0000000000000000FFFF00000100007F",
                         "00000000000000000000000001000000") for a in addresses), \
            (external[0], rank, addresses)


def test_forked_ranks_serve_the_store_on_a_socket_bound_before_they_start(monkeypatch):
    """A port found free and bound later can be taken in between (a concurrent test's gloo
    connection took one: rank 0 failed with "Address already in use"). Forked ranks inherit a
    socket already listening, so a taken port never reaches them: here every port `free_port`
    could give is one another socket holds."""
    import socket

    from megapar import launcher

    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    monkeypatch.setattr(launcher, "free_port", lambda: taken.getsockname()[1])
    try:
        assert run_local(_sum_ranks, 2) == [1.0, 1.0]
    finally:
        taken.close()


def test_workers_that_build_no_optimizer_are_forked_without_torch_dynamo():
    """torch._dynamo (1.2 s of CPU to import) is imported before forking only for workers that
    build optimizers (torch imports it when one is built): megapar-eval's ranks and the
    pipeline-only runs (megapar-bubble's measurement, --certify's real steps) start without
    it. A fresh interpreter: this one has imported dynamo already."""
    import os
    import subprocess

    probe = (
        "import sys\n"
        "from megapar.launcher import run_local\n"
        "def loaded():\n"
        "    return 'torch._dynamo' in sys.modules\n"
        "print(run_local(loaded, 2, optimizers=False), 'torch._dynamo' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "MEGAPAR_CPU": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["[False, False] False"], done.stdout


def test_the_commands_whose_workers_build_no_optimizer_say_so(monkeypatch, tmp_path):
    """megapar-eval, megapar-bubble's measurement and --certify's real steps pass
    optimizers=False (the test above: their workers then start without torch._dynamo)."""
    import megapar.cli.eval
    import megapar.cli.worker_exit
    import megapar.pipeline.certify_real
    import megapar.training.bubble
    from megapar.pipeline.certify import certify

    monkeypatch.setenv("HOME", str(tmp_path))  # megapar-eval's log of the stopped ranks
    seen = {}

    class Stop(Exception):
        pass

    def record(name):
        def launch(*args, **kwargs):
            seen[name] = kwargs.get("optimizers", True)
            raise Stop
        return launch

    monkeypatch.setattr(megapar.cli.worker_exit, "run_workers", record("eval"))
    monkeypatch.setattr(megapar.pipeline.certify_real, "run_local", record("certify"))
    monkeypatch.setattr(megapar.training.bubble, "run_local", record("bubble"))
    from test_checkpoint_helpers import save_serial

    save_serial(tmp_path / "ckpt")
    import numpy as np

    np.save(tmp_path / "ids.npy", np.arange(16, dtype=np.int64).reshape(2, 8))
    megapar.cli.eval.main(["--load", str(tmp_path / "ckpt"), "--input-ids",
                           str(tmp_path / "ids.npy"), "--save-logits", str(tmp_path / "l.npy")])
    with pytest.raises(Stop):
        megapar.pipeline.certify_real.check_real_steps([certify("1f1b", 2, 3)])
    with pytest.raises(Stop):
        megapar.training.bubble.measure(2, 2, "1f1b")
    assert seen == {"eval": False, "certify": False, "bubble": False}, seen


def _returns_a_process_group():
    return dist.group.WORLD  # a ProcessGroup: what an engine returned from fn holds


def test_a_return_value_that_cannot_leave_its_worker_is_named_in_one_line():
    with pytest.raises(WorkerError) as info:
        run_local(_returns_a_process_group, 2, timeout_s=60)
    first = str(info.value).splitlines()[0]
    assert first.startswith("rank 0 failed: UnsendableResult: rank 0's fn returned a value of type ")
    assert "cannot pickle" in first and "not the engine" in first
    assert "Traceback" not in str(info.value)  # the line says it all


def _rank_of_attempt(rank, port, attempt, out):
    """Rank `rank` of 2 in torchrun's attempt `attempt` (TORCHELASTIC_RESTART_COUNT), its
    store the agent's at `port`: joins the default group, makes a group of both ranks and sums
    over it; reports (rank, the sum or the error's type)."""
    import os
    from datetime import timedelta

    from megapar.device import init_distributed

    for name in ("TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_NTASKS"):
        os.environ.pop(name, None)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TORCHELASTIC_USE_AGENT_STORE="True",
                      TORCHELASTIC_RESTART_COUNT=str(attempt), OMP_NUM_THREADS="1")
    try:
        init_distributed(rank, 2, timeout_s=5)
        both = dist.new_group([0, 1], timeout=timedelta(seconds=5))
        total = torch.ones(1)
        dist.all_reduce(total, group=both)
        out.put((rank, total.item()))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        out.put((rank, type(exc).__name__))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_a_torchrun_restart_joins_on_keys_of_its_own_attempt():
    """torchrun's static rendezvous (--master-addr / --master-port, as launch/ uses) keeps its
    agent's store for every restart of --max-restarts, and torch's env:// rendezvous does not
    prefix it by attempt: after a kill -9 of rank 1 and torchrun's restart, the new ranks read
    the dead ranks' gloo addresses from the attempt before and hung in the mesh's first group
    (13 minutes, until SIGTERM). Each attempt now joins on keys of its own."""
    import multiprocessing as mp
    from datetime import timedelta

    from megapar.launcher import free_port

    port, ctx = free_port(), mp.get_context("fork")
    agent = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=10))
    out = ctx.Queue()
    for attempt in (0, 1):
        procs = [ctx.Process(target=_rank_of_attempt, args=(r, port, attempt, out))
                 for r in range(2)]
        results = _results_by_rank(procs, out, 60)
        assert results == {0: 2.0, 1: 2.0}, (attempt, results)
    del agent


def _mesh_without_rank_3():
    """Ranks 0-2 build a tp 2 x dp 2 mesh; rank 3 never comes (hung before it)."""
    from megapar.mesh import Layout, Mesh

    if dist.get_rank() == 3:
        time.sleep(60)
    Mesh(Layout(tp=2, dp=2), dist.get_rank())


def test_a_rank_that_never_creates_its_group_is_named_with_the_flag():
    """gloo's wait for a group's members ends after --timeout-s (3 s here: at 1 s, a machine at
    load 20 timed the healthy ranks' own connections out first), but said only
    'DistStoreError: wait timeout after 1000ms, keys: /default_pg/0//1//cpu//0/1': the line
    names the rank that never came and the flag, and the run ends in seconds."""
    start = time.monotonic()
    with pytest.raises(WorkerError) as info:
        run_local(_mesh_without_rank_3, 4, timeout_s=60, collective_timeout_s=3)
    took = time.monotonic() - start
    message = str(info.value)
    assert message.startswith("rank 3 did not answer"), message  # the launcher's blame
    said = message.split("\n")[1]  # then: each rank's own line
    assert ("rank 2: TimeoutError: rank 2 waited 3 s for ranks 2 and 3 to create process group "
            "mesh_tp and rank 3 never did (") in said and "keys:" not in said, said
    assert said.count("--timeout-s sets the wait") == 3, said
    assert took < 20, took


def test_a_member_that_gave_its_address_and_died_ends_the_join_in_twice_the_timeout(tmp_path):
    """A restarted rank that reads a dead rank's gloo address (torchrun's store kept the
    attempt before's keys) fails at once; a rank waiting for a connection that never comes
    waited 5 x --timeout-s inside gloo (the 13-minute restart hang). It ends after 2 x, in one
    line naming the flag, exit code 124 (`JOIN_BOUND_EXIT`). Which rank waits depends on the ports (gloo's initiator
    is picked from the addresses): the attempts go on until one does."""
    import multiprocessing as mp
    from datetime import timedelta

    from megapar.launcher import free_port

    port, ctx = free_port(), mp.get_context("fork")
    agent = dist.TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=30),
                          wait_for_workers=False)  # torchrun's agent's, kept across attempts
    # 30 attempts: with 7, on 2026-12-03 one run in five (one clean-clone run too) had every
    # attempt after the first join, reading the fresh keys (0.2-0.3 s an attempt)
    for attempt in range(1, 31):
        errs = [tmp_path / f"{attempt}-{r}.txt" for r in range(2)]
        procs = [ctx.Process(target=_join_alone_writing, args=(r, port, 1.0, errs[r]))
                 for r in range(2)]
        start = time.monotonic()
        for p in procs:
            p.start()
        join_or_kill(procs, 30)
        took, codes = time.monotonic() - start, [p.exitcode for p in procs]
        texts = [e.read_text() for e in errs]
        if attempt == 1:
            assert codes == [0, 0], texts  # the attempt whose keys the next ones read
        elif 124 in codes or took > 4.5:
            break
    del agent
    assert took < 4.5 and set(codes) <= {124, 3}, (took, codes, texts)
    for rank in (r for r in range(2) if codes[r] == 124):  # (JOIN_BOUND_EXIT)
        lines = [x for x in texts[rank].splitlines() if x.startswith("megapar: ")]
        assert lines == [f"megapar: rank {rank}: joining the process group did not complete "
                         f"in 2 s (2 x --timeout-s 1): a member gave its address and then did "
                         f"not connect (it died or stopped); exiting with code 124"], texts[rank]


def _join_alone_writing(rank, port, wait_s, err):
    """Rank `rank` of 2 joining under torchrun's agent store at `port` (the other rank
    started beside it, or not at all); its stderr to the file `err`, an error's type and text
    there and exit 3, or exit 0 joined."""
    import os

    from megapar import device

    for name in ("TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "SLURM_PROCID"):
        os.environ.pop(name, None)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE="2", TORCHELASTIC_USE_AGENT_STORE="True")
    fd = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(fd, 2)
    try:
        device.init_distributed(rank=rank, world_size=2, timeout_s=wait_s)
    except Exception as exc:  # noqa: BLE001 - its end is the test
        os.write(2, f"{type(exc).__name__}: {exc}\n".encode())
        os._exit(3)
    os._exit(0)


def test_a_rank_refused_by_a_dead_members_address_says_so_in_one_line(tmp_path):
    """Rank 0 gives its gloo address in the store and dies; rank 1 then reads it. Where rank 1
    is the pair's connecting side (gloo picks it from the two addresses: the tries, each with
    a dead rank 0 of its own, go on until it is), the refused connection failed at once with gloo's "Gloo connectFullMesh failed
    with [...pair.cc:152] timed out connecting: SO_ERROR: Connection refused, remote=[...]";
    it is one line naming the rank, the address and what to check."""
    import multiprocessing as mp
    import re
    from datetime import timedelta

    from megapar.launcher import free_port

    port, ctx = free_port(), mp.get_context("fork")
    agent = dist.TCPStore("127.0.0.1", port, 2, True, timedelta(seconds=30),
                          wait_for_workers=False)

    def alone(rank, name):
        err = tmp_path / name
        proc = ctx.Process(target=_join_alone_writing, args=(rank, port, 0.5, err))
        start = time.monotonic()
        proc.start()
        proc.join(timeout=30)
        return proc.exitcode, time.monotonic() - start, err.read_text()

    for attempt in range(12):  # each with a dead address of its own (gloo's side: its port)
        dead = alone(0, f"rank0-{attempt}.txt")  # gave its address, gave up waiting for rank 1
        assert dead[0] != 0, dead
        code, took, text = alone(1, f"rank1-{attempt}.txt")
        if code == 3:
            break
        assert code == 124, text  # the waiting side: connect_bound's line after 2 x 0.5 s
    del agent
    assert code == 3 and took < 20, (code, took, text)  # gloo's 3 retries at most: no wait
    # gloo's own log lines (C++: its retries, its error) stay; then one line, no traceback
    assert "Traceback" not in text, text
    assert re.fullmatch(
        r"ConnectionError: rank 1 could not connect to a member of its group at "
        r"127\.0\.0\.1:\d+ while joining the process group \(gloo: [^)]*Connection refused\): "
        r"check that every rank has the same MASTER_ADDR / MASTER_PORT \(else it reads another "
        r"job's or an earlier attempt's addresses\) and that the node at 127\.0\.0\.1 is up and "
        r"reachable from this one; --timeout-s \(0\.5 s\) bounds how long the members may take "
        r"to join", text.splitlines()[-1]), text


@pytest.mark.parametrize(("env", "threads"), [
    ({"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
      "SLURM_TASKS_PER_NODE": "2(x2)"}, [1]),
    ({"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1",
      "SLURM_TASKS_PER_NODE": "2(x2)", "OMP_NUM_THREADS": "4"}, []),
])
def test_srun_tasks_on_one_node_take_one_thread_each_as_torchruns_do(monkeypatch, env, threads):
    """srun without torchrun: each of a node's tasks ran torch on every core (torchrun sets
    OMP_NUM_THREADS=1 for its workers), 10 to 20 x slower on a CPU rehearsal (a helper's
    find). Each takes one thread now, unless OMP_NUM_THREADS says otherwise."""
    from megapar import device, launcher

    class Stop(Exception):
        pass

    def stop():
        raise Stop

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS",
                 "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    set_to = []
    monkeypatch.setattr(torch, "set_num_threads", set_to.append)
    monkeypatch.setattr(device, "adopt_slurm_environment", stop)
    with pytest.raises(Stop):
        launcher.run_workers(lambda: None, 4)
    assert set_to == threads


@pytest.mark.parametrize("layout, per_node, said", [
    (dict(tp=2, pp=1, dp=2), 2, " on 2 nodes of 2 ranks (dp across them)"),
    (dict(tp=1, pp=2, dp=1), 1, " on 2 nodes of 1 rank (pp across them)"),
    (dict(tp=4, pp=4, dp=2, order="tp-dp-pp"), 8, " on 4 nodes of 8 ranks (pp across them)"),
    (dict(tp=2, pp=2, dp=4), 2, " on 8 nodes of 2 ranks (pp and dp across them)"),
    (dict(tp=2, pp=1, dp=2), 4, ""),  # one node
    # 3 ranks a node: tp's group {2, 3} spans nodes 0 and 1 (a re-test's finding: rank 0's
    # groups alone were looked at)
    (dict(tp=2, pp=1, dp=3), 3, " on 2 nodes of 3 ranks (tp and dp across them)"),
])
def test_the_first_line_says_which_groups_cross_nodes_under_torchrun(monkeypatch, layout,
                                                                     per_node, said):
    """Two torchrun nodes' logs said nothing of nodes: rank 0 printed tp=2 pp=1 dp=2 alone (a
    multi-node rehearsal's finding); now how many nodes, and which groups span them."""
    from megapar.mesh import Layout
    from megapar.training.loop import nodes_phrase

    shape = Layout(**layout)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(shape.world_size))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(per_node))
    assert nodes_phrase(shape) == said
    monkeypatch.delenv("RANK")  # megapar-train's own workers: one machine
    monkeypatch.delenv("WORLD_SIZE")
    assert nodes_phrase(shape) == ""


def test_a_tp_group_across_nodes_is_noted_with_the_tp_that_stays_inside():
    """tp 2 on nodes of 3 (and tp 16 on nodes of 8) trained with "(tp ... across them)" alone,
    where megapar-plan refuses tp across nodes (a launch-script tryout): the log's note, which
    the dry run prints too, names the tp that stays inside a node."""
    from megapar.mesh import Layout
    from megapar.training.loop import tp_across_nodes

    tail = ("every layer's tp collectives cross the link between nodes, which megapar-plan "
            "refuses for tp; ")
    assert tp_across_nodes(Layout(tp=2, dp=3), 3) == (
        f"tp 2 spans nodes of 3 ranks: {tail}give a --tp that divides 3")
    assert tp_across_nodes(Layout(tp=16), 8) == f"tp 16 spans nodes of 8 ranks: {tail}keep --tp 8 or less"
    assert tp_across_nodes(Layout(tp=2, dp=4), 2) == tp_across_nodes(Layout(dp=4), 1) == ""
    # the rule (`mesh.tp_spans_nodes`, which megapar-plan applies too) is the groups' own
    for tp in (1, 2, 3, 4, 6):
        for dp in (1, 2, 3, 4):
            for per_node in (1, 2, 3, 4, 5, 8):
                layout = Layout(tp=tp, dp=dp)
                assert layout.tp_spans_nodes(per_node) == (
                    "tp" in layout.across_nodes(per_node)), (tp, dp, per_node)
