"""The shared-GPU tier: several ranks as processes on the one GPU, gloo carrying CUDA tensors.

Every test is marked `cuda(gpus=1)` and skipped without a GPU (`tools/gpu_check.sh` runs it with
the other tiers; `tools/gpu_session.sh` as a part of its own). The ranks are spawned (CUDA cannot
be forked) with `MEGAPAR_SHARED_GPU=1` (`megapar/shared_gpu.py`): each takes cuda:0, the backend
is gloo, all-reduces and broadcasts go to gloo as CUDA tensors (gloo's own copies through pinned
host memory, on its own stream) and every other op is staged through the host. So one GPU runs
the device placement, the streams and the memory of several CUDA processes; what only NCCL
between GPUs shows (its issue order, group calls, kernels) stays with tests/test_cuda.py.

Parity, fp32 (TF32 off), 1e-5 relative, against one process on the GPU (itself checked against
the plain-torch serial reference on the CPU): GPT-2 at tp 2, at pp 2 (1F1B) and at dp 2 with
ZeRO-3 (the harnesses of test_parity_3d.py and test_zero3.py: losses, grad norms, first-step
gradients, final weights over 5 steps), and the mixtral-tiny recipe at dp 2 x ep 2 (losses,
grad norms, router statistics, first-step gradients, final weights over 3 steps); then four
ranks: tp 2 x pp 2, tp 2 x dp 2 with ZeRO-3 and dp 4 x ep 2. Each rank reports where it ran and
its peak device memory (MEGAPAR_GPU_REPORT, as tests/test_cuda_single.py's figures). With
torchao, ZeRO-3's float8 all-gather at dp 2 (`--fp8 tensorwise`, the GPU's float8 kernels
where it has them) against fp32 gathers, bitwise; the 16-bit all-gathers of ZeRO-3 and of
ZeRO-1 / 2 (bf16) against fp32 gathers, bitwise.

`MEGAPAR_CUDA_TIER_ON_CPU=1` rehearses it on the CPU: the same spawned ranks and staging (on the
CPU it copies host tensors too), under the device model of tests/device_model.py.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from test_cuda import _tier_worker
from test_cuda_single import record
from tp_utils import assert_close

from megapar.launcher import run_local
from megapar.shared_gpu import SHARED_GPU_ENV

ON_CPU = os.environ.get("MEGAPAR_CUDA_TIER_ON_CPU") == "1"
pytestmark = pytest.mark.cuda(gpus=1)

TWO = [("3d", (2, 1, 1, 0)), ("3d", (1, 2, 1, 0)), ("zero3", (1, 1, 2)), ("moe", (1, 1, 2, 2))]
"""tp 2; pp 2 (1F1B); dp 2, ZeRO-3; mixtral-tiny at dp 2 x ep 2."""
FOUR = [("3d", (2, 2, 1, 0)), ("zero3", (2, 1, 2)), ("moe", (1, 1, 4, 2))]
"""tp 2 x pp 2; tp 2 x dp 2, ZeRO-3; mixtral-tiny at dp 4 x ep 2."""
ONE = [("3d", (1, 1, 1, 0)), ("moe", (1, 1, 1, 1))]
"""The one-process references of both models."""


def run_shared(n: int, runs: list) -> list:
    """`runs` on n spawned ranks sharing GPU 0 over gloo (the CPU in a rehearsal, under the
    device model); each rank's results on the host, then where it ran."""
    env = {"MEGAPAR_CPU": "1" if ON_CPU else "0", SHARED_GPU_ENV: "1"}
    return run_local(_tier_worker, n, _worker, ON_CPU, runs, start_method="spawn", env=env,
                     timeout_s=900 if ON_CPU else 300, collective_timeout_s=120)


def _worker(runs: list) -> list:
    """Every run on this rank, then where it ran: device, backend, the staging installed, its
    peak device memory. One process makes a gloo group of its own (the harnesses ask for
    its rank), without the staging."""
    import torch.distributed as dist

    from megapar import device, shared_gpu

    if not dist.is_initialized():  # one process: the harnesses ask for its rank
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    out = [_run(kind, args) for kind, args in runs]
    cuda = device.use_cuda()
    out.append({"device": str(device.device()), "backend": dist.get_backend(),
                "staged": shared_gpu.installed(),
                "pid": os.getpid(), "cuda_initialized": torch.cuda.is_initialized(),
                "peak_allocated": torch.cuda.max_memory_allocated() if cuda else 0,
                "peak_reserved": torch.cuda.max_memory_reserved() if cuda else 0})
    return out


def _run(kind: str, args: tuple) -> dict:
    if kind == "3d":
        from test_parity_3d import _train

        return _train(*args)
    if kind == "zero3":
        from test_zero3 import _train as _train_zero3

        return _train_zero3(*args)
    return _moe(*args)


def _moe(tp: int, pp: int, dp: int, ep: int) -> dict:
    """mixtral-tiny (4 experts, top 2) trained 3 steps with test_moe_parallel.py's batches and
    settings, its batches on the mesh's device: results, first-step gradients and final weights
    (experts gathered over ep) of tp rank 0 / dp rank 0."""
    import torch.distributed as dist
    from test_moe_ep import EPS, WD, _whole
    from test_moe_parallel import LR, MAX_NORM, MBS, SEED, SEQ, G, global_batches, scheduler
    from tp_utils import to_device

    from megapar.data_parallel import build_grad_sync
    from megapar.mesh import Layout, Mesh
    from megapar.models.recipes import resolve_model
    from megapar.optim import Precision, build_optimizer
    from megapar.pipeline.executor import PipelineExecutor
    from megapar.pipeline.partition import build_stage
    from megapar.training.step import BatchPlan, TrainStep

    config = resolve_model("mixtral-tiny")
    rank = dist.get_rank() if dist.is_initialized() else 0
    mesh = Mesh(Layout(tp, pp, dp, "tp-pp-dp", 1, ep), rank)
    model = build_stage(config, mesh, SEED)
    executor = PipelineExecutor(model, mesh, "1f1b", (MBS, SEQ, config.hidden_size))
    optimizer = build_optimizer(model, mesh, LR, WD, eps=EPS)
    grad_sync = build_grad_sync(model, mesh, 0, bucket_mb=0.02) if dp > 1 else None
    step = TrainStep(model, mesh, executor, optimizer, scheduler(), Precision("fp32", mesh.device),
                     MAX_NORM, grad_sync)
    grads, optimizer_step = {}, optimizer.step

    def record_first_grads_then_step():
        if not grads:
            grads.update({n: _whole(p.grad, p, mesh) for n, p in model.named_parameters()})
        optimizer_step()

    optimizer.step = record_first_grads_then_step
    plan = BatchPlan(G, MBS, dp)
    results = [step.step(to_device(plan.split(b, mesh.dp_rank), mesh.device), i)
               for i, b in enumerate(global_batches())]
    weights = {n: _whole(p.detach(), p, mesh) for n, p in model.named_parameters()}
    keep = mesh.dp_rank == 0 and mesh.tp_rank == 0
    return {"layout": (tp, pp, dp, ep), "results": results,
            "weights": weights if keep else {}, "grads": grads if keep else {}}


def _as_reference(out: dict) -> dict:
    return {"losses": [r.loss for r in out["results"]],
            "norms": [r.grad_norm for r in out["results"]],
            "routers": [r.router for r in out["results"]],
            "weights": out["weights"], "grads": out["grads"]}


def _check_moe(reference: dict, per_rank: list[dict]) -> None:
    layout = per_rank[0]["layout"]
    merged: dict[str, dict] = {"weights": {}, "grads": {}}
    for rank, out in enumerate(per_rank):
        for s, r in enumerate(out["results"]):
            what = f"mixtral-tiny {layout} rank {rank} step {s}"
            assert_close(torch.tensor(r.loss), torch.tensor(reference["losses"][s]),
                         what=f"{what} loss")
            assert_close(torch.tensor(r.grad_norm), torch.tensor(reference["norms"][s]),
                         what=f"{what} grad norm")
            ref = reference["routers"][s]
            for key in ("aux_loss", "z_loss", "imbalance"):
                assert_close(torch.tensor(r.router[key]), torch.tensor(ref[key]),
                             what=f"{what} {key}")
            assert r.router["tokens_per_expert"] == ref["tokens_per_expert"], what
        for key in merged:
            merged[key].update(out[key])
    for key in merged:
        assert set(merged[key]) == set(reference[key]), f"mixtral-tiny {layout}: {key} names"
        for name, t in merged[key].items():
            assert_close(t, reference[key][name], what=f"mixtral-tiny {layout} {key} {name}")


@pytest.fixture(scope="module")
def one_process():
    """The one-process runs on the GPU (a spawned process: this one keeps no CUDA context),
    the GPT-2 one checked against the plain-torch serial reference on the CPU."""
    from test_parity_3d import check_against, serial_reference

    (dense, moe, where), = run_shared(1, ONE)
    assert not where["staged"]  # one process: a group of its own, nothing staged
    with pytest.MonkeyPatch.context() as env:
        env.setenv("MEGAPAR_CPU", "1")
        check_against(serial_reference(), [dense])
    assert moe["results"][-1].loss < moe["results"][0].loss
    return {"3d": _as_reference(dense), "zero3": _as_reference(dense), "moe": _as_reference(moe)}


def _check_where(outs: list, n: int) -> None:
    """Every rank a process of its own, on the tier's device, over gloo with the staging."""
    where = [o[-1] for o in outs]
    assert len({w["pid"] for w in where}) == n
    assert all(w["backend"] == "gloo" and w["staged"] for w in where), where
    if not ON_CPU:
        assert {w["device"] for w in where} == {"cuda:0"}, where
        assert all(w["cuda_initialized"] and w["peak_allocated"] > 0 for w in where), where
    else:
        assert {w["device"] for w in where} == {"cpu"}, where


def _check_layouts(reference: dict, runs: list, outs: list) -> None:
    from test_parity_3d import check_against

    for i, (kind, _) in enumerate(runs):
        per_rank = [o[i] for o in outs]
        if kind == "moe":
            _check_moe(reference["moe"], per_rank)
        else:
            check_against(reference[kind], per_rank)
            if kind == "zero3":
                assert all(o["freed"] for o in per_rank)


@pytest.mark.parametrize("n,runs", [(2, TWO), (4, FOUR)], ids=["2-ranks", "4-ranks"])
def test_ranks_sharing_the_gpu_match_one_process(one_process, n, runs):
    outs = run_shared(n, runs)
    _check_where(outs, n)
    _check_layouts(one_process, runs, outs)
    where = [o[-1] for o in outs]
    record(f"shared gpu, {n} ranks", layouts=len(runs),
           peak_allocated_mib=[round(w["peak_allocated"] / 2**20, 1) for w in where],
           peak_reserved_mib=[round(w["peak_reserved"] / 2**20, 1) for w in where])


def test_zero3_gathers_float8_weights_across_processes_on_the_gpu():
    """ZeRO-3's float8 all-gather (--fp8 tensorwise) at dp 2 with both ranks on the one GPU,
    gloo staging the uint8 gathers through the host: tests/test_fp8.py's check on the GPU
    (torch's float8 kernels where it has FP8 matmuls, else the emulation): three steps and an
    evaluation bitwise those of fp32 gathers with per-use casts, the float8 units gathered as
    a quarter of the bytes, one amax all-reduce a step over dp."""
    if importlib.util.find_spec("torchao") is None:
        pytest.skip("torchao is not installed (tools/gpu_session.sh installs it from wheels/)")
    from test_fp8 import GBS, GPT, STEPS, _zero3_float8

    env = {"MEGAPAR_CPU": "1" if ON_CPU else "0", SHARED_GPU_ENV: "1"}
    outs = run_local(_tier_worker, 2, _zero3_float8, ON_CPU, "tensorwise", 1,
                     start_method="spawn", env=env, timeout_s=900 if ON_CPU else 300,
                     collective_timeout_s=120)
    m = GBS // 2 // 2
    for on, off in outs:
        assert (on[0], on[1]) == (off[0], off[1]), (on[:2], off[:2])
        assert on[2] == [2 * m * sum(on[4]) // 2] * STEPS and off[2] == [0] * STEPS
        assert on[3] == [[4 * GPT["n_layer"]]] * STEPS
    record("shared gpu, zero-3 float8 all-gather", losses=outs[0][0][0],
           float8_bytes_a_step=outs[0][0][2][0])


def test_zero3_gathers_16_bit_weights_across_processes_on_the_gpu():
    """ZeRO-3's 16-bit all-gather (bf16 autocast) at dp 2 with both ranks on the one GPU,
    gloo staging the bf16 gathers through the host: tests/test_zero3_half.py's check with
    CUDA's autocast and cuBLAS: three steps and an evaluation bitwise those of fp32 gathers,
    the blocks' linear weights gathered at 2 bytes an element."""
    from test_zero3_half import GBS, STEPS, _steps

    env = {"MEGAPAR_CPU": "1" if ON_CPU else "0", SHARED_GPU_ENV: "1"}
    outs = run_local(_tier_worker, 2, _steps, ON_CPU, "gpt2", {}, start_method="spawn",
                     env=env, timeout_s=900 if ON_CPU else 300, collective_timeout_s=120)
    m = GBS // 2 // 2
    for on, off in outs:
        assert (on[0], on[1]) == (off[0], off[1]), (on[:2], off[:2])
        assert on[2] == [2 * m * sum(on[4]) // 2] * STEPS and off[2] == [0] * STEPS
    record("shared gpu, zero-3 16-bit all-gather", losses=outs[0][0][0],
           bf16_bytes_a_step=outs[0][0][2][0])



def _zero12_both(kind: str) -> list:
    """tests/test_zero12_half.py's comparison under ZeRO-1 and under ZeRO-2, in one spawn."""
    from test_zero12_half import _compare

    return [_compare(kind, {"zero": zero}) for zero in (1, 2)]


def test_zero12_gathers_16_bit_weights_across_processes_on_the_gpu():
    """ZeRO-1 and ZeRO-2's 16-bit all-gather after the step (bf16 autocast) at dp 2 with both
    ranks on the one GPU, gloo staging the bf16 gathers through the host:
    tests/test_zero12_half.py's check with CUDA's autocast and cuBLAS: three steps, an
    evaluation and the weights made exact bitwise those of fp32 gathers, the 16-bit buckets
    gathered at 2 bytes an element."""
    from test_zero12_half import _check

    env = {"MEGAPAR_CPU": "1" if ON_CPU else "0", SHARED_GPU_ENV: "1"}
    outs = run_local(_tier_worker, 2, _zero12_both, ON_CPU, "gpt2", start_method="spawn",
                     env=env, timeout_s=900 if ON_CPU else 300, collective_timeout_s=120)
    for per_zero in outs:
        for ours, theirs in per_zero:
            _check(ours, theirs)
    for zero, (ours, _) in zip((1, 2), outs[0]):
        record(f"shared gpu, zero-{zero} 16-bit all-gather", losses=[s[0] for s in ours[0]],
               bf16_bytes_a_step=ours[3][0][0])
