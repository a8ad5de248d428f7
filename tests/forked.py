"""The tests' forked child: a command run in a process of its own, so the signals a test sends
it (or its launcher) never reach pytest."""

import os
import sys


def fork_running(fn, out) -> int:
    """Fork a child that runs `fn()` with its stdout and stderr in the file `out` (not pytest's
    capture) and exits with what `fn` returns (3 if it raises); returns the child's pid."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        sys.stdout = sys.stderr = open(fd, "w", buffering=1)
        rc = 3
        try:
            rc = fn()
        finally:
            os._exit(rc)
    return pid


def exit_code(pid: int) -> int:
    """The exit code of child `pid`, once it has ended (-N: killed by signal N)."""
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def torchrun_ranks(fn, world_size: int, directory) -> tuple[list[int], list[str]]:
    """`fn()` (a command's `main(argv)`, say) in `world_size` forked children, each with the
    variables torchrun gives its rank on one node (RANK, LOCAL_RANK, WORLD_SIZE,
    LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT: a free port), as the processes a torchrun job
    starts; returns their exit codes and their outputs (stdout and stderr, each kept in
    `directory`/out<rank>), by rank."""
    from pathlib import Path

    from megapar.launcher import free_port

    port = str(free_port())

    def rank(r):
        def run():
            os.environ.update({"RANK": str(r), "LOCAL_RANK": str(r),
                               "WORLD_SIZE": str(world_size),
                               "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1",
                               "MASTER_PORT": port})
            return fn()
        return run

    outs = [Path(directory) / f"out{r}" for r in range(world_size)]
    pids = [fork_running(rank(r), out) for r, out in enumerate(outs)]
    codes = [exit_code(pid) for pid in pids]
    return codes, [out.read_text() for out in outs]


def join_or_kill(procs, timeout_s: float) -> None:
    """Join the multiprocessing children `procs`, each within `timeout_s`; one still alive then
    is killed (and reaped), so a hung child never outlives its test."""
    for p in procs:
        p.join(timeout=timeout_s)
        if p.is_alive():
            p.kill()
            p.join()


def run_python(args, env: dict, timeout_s: float, directory, cwd=None) -> tuple[int, str, str]:
    """`python3 ARGS` (a script and its arguments, or `-m MODULE ARGS`) run in a forked child of
    this process, which has imported torch and transformers already (a fresh interpreter spends
    5-6 s of CPU importing them): the child takes `env` as its environment, /dev/null as its
    stdin, and runs ARGS as `__main__` as the interpreter would (a script's directory first on
    sys.path) in `cwd` (this process's by default). Returns (exit code, stdout, stderr); the
    child is killed after `timeout_s`. `directory`: where its output is kept."""
    import runpy
    import time
    import traceback
    from pathlib import Path

    out, err = Path(directory) / "stdout.txt", Path(directory) / "stderr.txt"
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 1
        try:
            for target, path, flags in ((0, os.devnull, os.O_RDONLY),
                                        (1, out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                                        (2, err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
                fd = os.open(path, flags)
                os.dup2(fd, target)
                os.close(fd)
            sys.stdin = open(0, closefd=False)
            sys.stdout = open(1, "w", closefd=False)
            sys.stderr = open(2, "w", buffering=1, closefd=False)
            os.environ.clear()
            os.environ.update(env)
            if cwd is not None:
                os.chdir(cwd)
            if args[0] == "-m":
                sys.argv = [args[1], *args[2:]]
                runpy.run_module(args[1], run_name="__main__", alter_sys=True)
            else:
                sys.argv = [str(a) for a in args]
                sys.path.insert(0, os.path.dirname(os.path.abspath(args[0])))
                runpy.run_path(str(args[0]), run_name="__main__")
            code = 0
        except SystemExit as exc:  # as the interpreter's exit reads it
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if not isinstance(exc.code, int | None):
                print(exc.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code & 0xFF)
    deadline = time.monotonic() + timeout_s
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            done = os.waitpid(pid, 0)
            break
        time.sleep(0.05)
    return os.waitstatus_to_exitcode(done[1]), out.read_text(), err.read_text()
