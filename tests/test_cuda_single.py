"""The tier of one GPU: what one process on one CUDA device can prove.

Every test is marked `cuda(gpus=1)` and skipped without a GPU (`tools/gpu_check.sh` runs them
with the multi-GPU tier of tests/test_cuda.py, whose tests need two GPUs or more). They run in
the pytest process, on cuda:0, each against a reference computed in the same process:

- GPT-2, BERT (with padding) and grouped-query Llama: three optimizer steps on the GPU equal
  the same steps on the CPU (fp32, TF32 off: losses, the first step's gradients and the final
  weights within 1e-5 relative); bf16 tracks fp32;
- the attention kernel actually used: FlashAttention for the causal models, the
  memory-efficient kernel for BERT's padding mask (SDPA restricted to that one backend);
- the fused AdamW kernel; a training step, after a warm-up step on the same executor, under
  CUDA's own check for host-device synchronisation (`torch.cuda.set_sync_debug_mode`);
- the step trace timed with CUDA events; `--tf32`; more ranks than GPUs refused in one line;
- context parallelism's fused attention kernels on CUDA against the fp32 reference kernel;
- a GPT-2 124M step's peak device memory against `megapar-plan`'s prediction (reported);
- the main job (`megapar-train` with no flags) on the GPU.

Figures a test measures are printed and, when MEGAPAR_GPU_REPORT names a file, appended to it
as JSON lines (`tools/gpu_session.sh` puts them in its report). `MEGAPAR_CUDA_TIER_ON_CPU=1`
rehearses the logic on the CPU (both sides on the CPU; the CUDA-only checks skipped inside).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
import subprocess
import sys
import time
import warnings

import pytest
import torch
from test_cuda import strict_syncs
from tp_utils import assert_close, rel_err

import megapar
from megapar.context_parallel.kernels import block_backward, block_forward, choose_kernel

ON_CPU = os.environ.get("MEGAPAR_CUDA_TIER_ON_CPU") == "1"
GPU = torch.device("cpu") if ON_CPU else torch.device("cuda", 0)
VOCAB, SEQ, G = 128, 32, 4
pytestmark = pytest.mark.cuda(gpus=1)


def on_cuda() -> bool:
    return GPU.type == "cuda"


def record(test: str, **values) -> None:
    """Print a measured figure and append it to MEGAPAR_GPU_REPORT (JSON lines)."""
    print(f"[gpu-report] {test}: {values}")
    path = os.environ.get("MEGAPAR_GPU_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": test, **values}) + "\n")


@contextlib.contextmanager
def placed(where: str):
    """megapar builds on the CPU ("cpu") or on this tier's GPU ("gpu") inside the block."""
    old = os.environ.get("MEGAPAR_CPU")
    os.environ["MEGAPAR_CPU"] = "1" if where == "cpu" or ON_CPU else "0"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("MEGAPAR_CPU", None)
        else:
            os.environ["MEGAPAR_CPU"] = old


def config(kind: str):
    """Tiny transformers configs without dropout (a GPU's dropout masks are not the CPU's)."""
    from transformers import BertConfig, GPT2Config, LlamaConfig

    if kind == "gpt2":
        return GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=SEQ, vocab_size=VOCAB,
                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    if kind == "llama":  # grouped-query: 4 query heads, 2 kv heads
        return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2,
                           max_position_embeddings=SEQ, vocab_size=VOCAB, bos_token_id=0,
                           eos_token_id=0)
    return BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=128, max_position_embeddings=SEQ, vocab_size=VOCAB,
                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def batch(kind: str, seed: int) -> dict:
    """A global batch of G sequences (BERT: masked-LM fields, two padded sequences)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, VOCAB, (G, SEQ), generator=gen)
    if kind != "bert":
        return {"input_ids": ids, "labels": (ids + 1) % VOCAB}
    mask = torch.ones_like(ids)
    mask[1, SEQ - 5:] = 0
    mask[3, SEQ // 2:] = 0
    labels = torch.where(torch.rand(ids.shape, generator=gen) < 0.3, ids, -100)
    labels[:, 1] = ids[:, 1]
    labels = labels.masked_fill(mask == 0, -100)
    types = (torch.arange(SEQ) >= SEQ // 2).long().expand(G, SEQ).contiguous()
    return {"input_ids": ids.masked_fill(mask == 0, 0), "labels": labels,
            "attention_mask": mask, "token_type_ids": types * mask}


def engine_on(where: str, kind: str, **options):
    settings = {"micro_batch_size": 2, "lr": 1e-3, "seq_len": SEQ, **options}
    with placed(where):
        return megapar.prepare(config(kind), **settings)


def train(where: str, kind: str, steps: int = 3, **options):
    """(losses, every step's gradients) of `steps` optimizer steps (a step's gradients come
    from the weights the steps before it made)."""
    engine = engine_on(where, kind, adam_eps=1e-4, **options)  # see the next test
    losses, grads = [], []
    for step in range(steps):
        losses.append(engine.train_step(batch(kind, step)))
        grads.append({n: p.grad.detach().cpu().clone()
                      for n, p in engine.model.named_parameters()})
    return losses, grads


# the models ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["gpt2", "bert", "llama"])
def test_three_steps_on_the_gpu_equal_the_cpu(kind):
    """fp32 with TF32 off (the engine's default): the loss and every gradient of three AdamW
    steps (the gradients of steps 2 and 3 come from the weights the optimizer made). The
    weights themselves are not compared element by element: Adam divides each gradient
    element by its own running size, so an element's last-bit difference becomes a relative
    difference of its update (measured: 8e-5 of a GPT-2 bias after 3 steps). eps 1e-4 keeps
    the noise of gradients that are zero in exact arithmetic (the attention key bias's) from
    being amplified into the next steps' weights."""
    cpu_losses, cpu_grads = train("cpu", kind)
    gpu_losses, gpu_grads = train("gpu", kind)
    assert not torch.backends.cuda.matmul.allow_tf32
    for step, (a, b) in enumerate(zip(gpu_losses, cpu_losses)):
        assert abs(a - b) <= 1e-5 * abs(b), (kind, step, a, b)
    for step, (gpu, cpu) in enumerate(zip(gpu_grads, cpu_grads)):
        for name in cpu:
            assert_close(gpu[name], cpu[name], what=f"{kind}: grad of {name} in step {step}")
    worst = max(rel_err(g[n], c[n]) for g, c in zip(gpu_grads, cpu_grads) for n in c)
    record(f"{kind} gpu == cpu", loss_rel=max(abs(a - b) / b for a, b in
                                              zip(gpu_losses, cpu_losses)), grad_rel=worst)


@pytest.mark.parametrize("kind", ["gpt2", "bert", "llama"])
def test_bf16_tracks_fp32_on_the_gpu(kind):
    """Losses within the CPU suite's 2e-2 (test_precision) and every gradient of the first
    step within 5e-2 in norm: a fused attention kernel that returned wrong gradients in bf16
    (flash, grouped-query flash, memory-efficient with BERT's mask) would be far off."""
    fp32, fp32_grads = train("gpu", kind)
    bf16, bf16_grads = train("gpu", kind, precision="bf16")
    assert bf16 != fp32, "bf16 gave fp32's losses: autocast is not active"
    for a, b in zip(bf16, fp32):
        assert abs(a - b) / b < 2e-2
    errors = {n: ((bf16_grads[0][n] - g).norm() / g.norm().clamp_min(1e-12)).item()
              for n, g in fp32_grads[0].items() if g.norm() > 0}
    worst = max(errors, key=errors.get)
    assert errors[worst] < 5e-2, (worst, errors[worst])
    record(f"{kind} bf16 vs fp32", losses_bf16=bf16, losses_fp32=fp32,
           worst_grad=worst, worst_grad_rel=errors[worst])


@pytest.mark.parametrize("kind,backend,precision", [
    ("gpt2", "FLASH_ATTENTION", "bf16"), ("llama", "FLASH_ATTENTION", "bf16"),
    ("bert", "EFFICIENT_ATTENTION", "fp32"), ("bert", "EFFICIENT_ATTENTION", "bf16")])
def test_attention_runs_the_fused_kernel(kind, backend, precision):
    """SDPA restricted to one backend raises "No available kernel" when a call cannot use it:
    causal GPT-2 and grouped-query Llama (enable_gqa, no expanded k / v) run FlashAttention in
    bf16, BERT's padding mask the memory-efficient kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    engine = engine_on("gpu", kind, precision=precision)
    only = sdpa_kernel([getattr(SDPBackend, backend)]) if on_cuda() else contextlib.nullcontext()
    with only:
        losses = [engine.train_step(batch(kind, step)) for step in range(2)]
    assert all(loss == loss for loss in losses)


def test_adamw_runs_the_fused_kernel():
    engine = engine_on("gpu", "gpt2")
    assert engine.optimizer.inner.defaults["fused"] is True
    assert {p.device.type for p in engine.model.parameters()} == {GPU.type}


# the step ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["gpt2", "bert", "llama"])
def test_a_step_after_warm_up_never_waits_for_the_device(kind):
    """The pipeline step (every micro-batch's forward and backward, the gradient buffer) under
    set_sync_debug_mode("error"); the whole optimizer step under "warn", its synchronisations
    counted: the batch's copies to the device, the loss and the gradient norm, once a step."""
    engine = engine_on("gpu", kind, micro_batch_size=1)  # 4 micro-batches
    engine.train_step(batch(kind, 0))  # warm-up: the executor of this length, Adam's state
    checked = strict_syncs(engine.executor)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if on_cuda():
            torch.cuda.set_sync_debug_mode("warn")
        try:
            loss = engine.train_step(batch(kind, 1))
        finally:
            if on_cuda():
                torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert checked == [1], "the strict executor is not the one the step ran"
    assert loss == loss
    assert len(syncs) <= 8, syncs
    record(f"{kind} host syncs per step", syncs=len(syncs), micro_batches=4)


def test_the_step_trace_is_timed_with_cuda_events():
    engine = engine_on("gpu", "gpt2", micro_batch_size=1)
    engine.train_step(batch("gpt2", 0))
    if on_cuda():
        torch.cuda.synchronize()
    start = time.perf_counter()
    engine.train_step(batch("gpt2", 1))
    if on_cuda():
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    assert engine.executor.clock.cuda == on_cuda()
    events = engine.executor.last_timeline.events
    computes = [e for e in events if e.kind in ("forward", "backward")]
    assert [e.kind for e in computes] == ["forward", "backward"] * 4  # 1F1B at pp 1
    assert all(e.end >= e.start for e in events)
    assert all(a.end <= b.start + 1e-6 for a, b in zip(computes, computes[1:]))  # one stream
    span = max(e.end for e in events) - min(e.start for e in events)
    busy = sum(e.end - e.start for e in computes)
    assert 0 < busy <= span <= wall + 1e-3, (busy, span, wall)
    record("cuda-event trace", step_s=wall, traced_span_s=span, compute_s=busy)


def test_tf32_is_the_flag_and_only_the_flag():
    engine_on("gpu", "gpt2", tf32=True)
    if on_cuda():
        assert torch.backends.cuda.matmul.allow_tf32
    engine_on("gpu", "gpt2")
    assert not torch.backends.cuda.matmul.allow_tf32
    if on_cuda():  # what it changes: a 4096 x 4096 fp32 product's error against fp64
        a, b = (torch.randn(4096, 4096, device=GPU) for _ in range(2))
        exact = a.double() @ b.double()
        errors = {}
        for tf32 in (False, True):
            torch.backends.cuda.matmul.allow_tf32 = tf32
            errors[tf32] = ((a @ b).double() - exact).norm().item() / exact.norm().item()
        torch.backends.cuda.matmul.allow_tf32 = False
        assert errors[False] < 1e-5 < errors[True]
        record("tf32", error_fp32=errors[False], error_tf32=errors[True])


@pytest.mark.skipif(ON_CPU, reason="needs the GPU count of a real machine")
def test_more_ranks_than_gpus_is_refused_in_one_line():
    if torch.cuda.device_count() != 1:
        pytest.skip("a machine of one GPU")
    run = subprocess.run([sys.executable, "-m", "megapar.cli.train", "--model", "gpt2-tiny",
                          "--tp", "2", "--max-steps", "1"], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "MEGAPAR_CPU": "0"})
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stderr.strip().count("\n") == 0, run.stderr
    assert "2 ranks on this node but 1 GPU visible" in run.stderr


# context parallelism's kernels ----------------------------------------------------------------
def _blocks(dtype, s_q, s_k, masked, seed=0, d=64):
    gen = torch.Generator().manual_seed(seed)
    b, h = 2, 4
    q, do = (torch.randn(b, h, s_q, d, generator=gen).to(GPU, dtype) for _ in range(2))
    k, v = (torch.randn(b, h, s_k, d, generator=gen).to(GPU, dtype) for _ in range(2))
    bias = None
    if masked:  # BERT's padding: 0 or the dtype's lowest, the second sequence half padding
        keep = torch.ones(b, s_k, dtype=torch.bool)
        keep[1, s_k // 2:] = False
        bias = torch.zeros(b, 1, 1, s_k, dtype=dtype).masked_fill(
            ~keep[:, None, None, :], torch.finfo(dtype).min).to(GPU)
    return q, k, v, do, bias


@pytest.mark.parametrize("head_dim", [64, 192], ids=["d64", "d192"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("causal,masked,s_k", [(True, False, 64), (False, False, 128),
                                               (False, True, 128), (False, True, 40)])
def test_cp_fused_kernels_equal_the_fp32_reference(dtype, causal, masked, s_k, head_dim):
    """A block of 64 queries against a block of keys (causal: its own positions; s_k 40: a
    key block whose length is not a multiple of the kernels' alignment) in the kernel
    `choose_kernel` picks, forward (out and log-sum-exp) and backward, against the fp32
    "math" kernel on the same inputs; head size 64 and DeepSeek-V3 MLA's 192 (fused on a GPU
    from sm80 on, where PyTorch runs flash up to 256)."""
    kernel = choose_kernel(GPU, 0.0, dtype, masked, head_dim)
    if on_cuda():
        half = dtype == torch.bfloat16
        assert kernel == ("cuda-flash" if half and not masked else "cuda-efficient")
    q, k, v, do, bias = _blocks(dtype, 64, s_k, masked, d=head_dim)
    out, lse = block_forward(q, k, v, causal, bias, kernel)
    ref_out, ref_lse = block_forward(q, k, v, causal, bias, "math")
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    assert out.dtype == dtype and lse.shape == ref_lse.shape == q.shape[:3]
    assert rel_err(out.float(), ref_out.float()) < tol
    assert rel_err(lse.float(), ref_lse.float()) < tol
    grads = block_backward(do, q, k, v, out, lse, causal, bias, kernel)
    ref_grads = block_backward(do, q, k, v, ref_out, ref_lse, causal, bias, "math")
    errors = [rel_err(g.float(), r.float()) for g, r in zip(grads, ref_grads)]
    assert max(errors) < tol, errors
    record(f"cp kernel {kernel}", dtype=str(dtype), causal=causal, masked=masked, s_k=s_k,
           head_dim=head_dim,
           out_rel=rel_err(out.float(), ref_out.float()), grad_rel=max(errors))


# --offload-optimizer ------------------------------------------------------------------------------
def test_offload_optimizer_steps_on_the_host_and_frees_the_moments():
    """--offload-optimizer on the GPU: three steps equal those without offload (fp32, TF32
    off, 1e-5: the host's fused AdamW against the device's), the masters are pinned host
    copies, and the device holds 8 bytes per parameter less (AdamW's moments), measured with
    the allocator (reported)."""
    from megapar.device import host_copies_wanted

    allocated = {}
    runs = {}
    for offload in (False, True):
        gc.collect()
        if on_cuda():
            torch.cuda.empty_cache()
        before = torch.cuda.memory_allocated() if on_cuda() else 0
        engine = engine_on("gpu", "gpt2", adam_eps=1e-4, offload_optimizer=offload)
        allocated[offload] = (torch.cuda.memory_allocated() if on_cuda() else 0) - before
        runs[offload] = ([engine.train_step(batch("gpt2", step)) for step in range(3)],
                         {n: p.detach().cpu().clone() for n, p in engine.model.named_parameters()})
        if offload:
            host = engine.optimizer.host
            assert host is not None and host.copies == host_copies_wanted(GPU)
            if on_cuda():
                assert all(m.device.type == "cpu" and m.is_pinned() for m in host.masters)
                assert all(t.device.type == "cpu" for s in engine.optimizer.inner.state.values()
                           for t in s.values())
            n = sum(p.numel() for p in engine.model.parameters())
        del engine
    for a, b in zip(*[runs[o][0] for o in (False, True)]):
        assert rel_err(torch.tensor(a), torch.tensor(b)) < 1e-5, (a, b)
    for name, w in runs[False][1].items():
        assert_close(runs[True][1][name], w, what=f"offloaded weight {name}")
    if on_cuda():
        saved = allocated[False] - allocated[True]
        record("offload_optimizer_device_bytes", params=n, without=allocated[False],
               with_offload=allocated[True], saved=saved, per_param=saved / n)
        # and the fused kernel's step counters: a float32 per tensor, each a 512-byte block
        assert saved == pytest.approx(8 * n, rel=0.05)


# --offload-params ---------------------------------------------------------------------------------
def test_offload_params_moves_the_parameter_shards_off_the_device(monkeypatch):
    """--zero 3 --offload-optimizer, with and without --offload-params, as rank 0 of dp 2 on
    the fake process group (one GPU: the collectives do nothing, so the values are not
    checked; the CPU tier's parity tests check them): the parameter shards are pinned host
    tensors, and the device holds their bytes less, measured with the allocator after
    building and after a step (the staging shards of the step's gathers freed; reported)."""
    import torch.distributed as dist

    from megapar.device import HOST_COPIES_ENV

    monkeypatch.setenv(HOST_COPIES_ENV, "1")  # the CPU rehearsal runs the copying path too
    monkeypatch.setenv("WORLD_SIZE", "2")  # Mesh.from_env: the layout is dp 2
    monkeypatch.setenv("RANK", "0")
    allocated, shard_bytes = {}, {}
    dist.init_process_group("fake", rank=0, world_size=2)
    try:
        for offload in (False, True):
            gc.collect()
            if on_cuda():
                torch.cuda.empty_cache()
            before = torch.cuda.memory_allocated() if on_cuda() else 0
            engine = engine_on("gpu", "gpt2", zero=3, offload_optimizer=True,
                               offload_params=offload, on_nonfinite="skip")
            built = (torch.cuda.memory_allocated() if on_cuda() else 0) - before
            units = engine.sharded_params.units
            shard_bytes[offload] = sum(u.shard_nbytes for u in units)
            if offload:
                assert all(u.host_shard is not None and u.host_shard.device.type == "cpu"
                           and u.shard.untyped_storage().nbytes() == 0 for u in units)
                assert all(u.host_shard.is_pinned() for u in units) == on_cuda()
                masters = {m.untyped_storage()._cdata for m in engine.optimizer.host.masters}
                assert masters <= {u.host_shard.untyped_storage()._cdata for u in units}
            else:
                assert all(u.host_shard is None and u.shard.device == GPU for u in units)
            engine.train_step(batch("gpt2", 0))
            assert all(u.shard.untyped_storage().nbytes() == 0 for u in units) == offload
            stepped = (torch.cuda.memory_allocated() if on_cuda() else 0) - before
            allocated[offload] = (built, stepped)
            del engine, units
    finally:
        dist.destroy_process_group()
    assert shard_bytes[False] == shard_bytes[True] > 0
    if on_cuda():
        saved = [a - b for a, b in zip(allocated[False], allocated[True])]
        record("offload_params_device_bytes", shard_bytes=shard_bytes[True],
               without=allocated[False], with_offload=allocated[True], saved=saved)
        for s in saved:  # each shard a block of its own (the allocator rounds to 512 bytes)
            assert s == pytest.approx(shard_bytes[True], rel=0.05)


# memory against the planner, the main job -------------------------------------------------------
def test_gpt2_124m_peak_memory_against_the_planner():
    """One bf16 step of GPT-2 124M at micro-batch 4 x 1024 tokens (after a warm-up step, so
    Adam's state exists): the device's peak allocated memory above what the process held
    before, against `megapar-plan`'s prediction for that layout (fused attention: flash
    keeps no scores). The ratio is the planner's first check on real hardware. Beside it what
    the OS side sees: the memory the allocator reserved at its peak, from building the engine
    to the end of the second step, and the CUDA context the process holds on top."""
    from megapar.models.recipes import resolve_model
    from megapar.plan import Candidate, Problem, stage_memory

    mbs, seq = (4, 1024) if on_cuda() else (1, 64)
    gc.collect()
    if on_cuda():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base, base_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    with placed("gpu"):
        engine = megapar.prepare("gpt2-124m", micro_batch_size=mbs, precision="bf16",
                                 seq_len=seq, lr=1e-4)
    ids = torch.randint(0, 50257, (mbs, seq + 1), generator=torch.Generator().manual_seed(0))
    data = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    engine.train_step(data)
    if not on_cuda():
        return
    torch.cuda.synchronize()
    held_first = torch.cuda.max_memory_reserved() - base_reserved  # build and first step
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    engine.train_step(data)
    torch.cuda.synchronize()
    step_s = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() - base
    held = max(held_first, torch.cuda.max_memory_reserved() - base_reserved)
    from megapar.device import cuda_context_bytes

    context = cuda_context_bytes(GPU)
    config = resolve_model("gpt2-124m")
    predicted = {fused: stage_memory(Problem(config, gpus=1, global_batch=mbs, seq_len=seq,
                                             precision="bf16", fused_attention=fused),
                                     Candidate(mbs=mbs))[0]
                 for fused in (True, False)}
    ratio = peak / predicted[True].total
    record("gpt2-124m peak memory", measured_gib=peak / 2**30,
           predicted_gib=predicted[True].total / 2**30,
           predicted_with_scores_gib=predicted[False].total / 2**30, ratio=ratio,
           held_gib=held / 2**30, held_ratio=held / predicted[True].total,
           context_gib=context / 2**30,
           breakdown_gib={k: v for k, v in predicted[True].as_gib().items()}, step_s=step_s)
    assert peak <= held  # reserved holds every allocation
    assert 0.5 < ratio < 2.0, ratio


@pytest.mark.skipif(ON_CPU, reason="the main job on the CPU is the README's (2 minutes)")
def test_the_main_job_on_the_gpu(tmp_path):
    """`megapar-train` with no flags: 300 steps of the 4-layer GPT-2 on the shipped sample."""
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "megapar.cli.train"], capture_output=True,
                         text=True, timeout=900, cwd=tmp_path,
                         env={**os.environ, "MEGAPAR_CPU": "0"})
    wall = time.perf_counter() - start
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = re.findall(r"step +300 \| loss ([0-9.]+) .*?tok/s ([0-9,]+) .*?MFU ([0-9.]+)%",
                       run.stdout + run.stderr)
    assert lines, (run.stdout + run.stderr)[-3000:]
    loss, tokens, mfu = float(lines[-1][0]), int(lines[-1][1].replace(",", "")), \
        float(lines[-1][2])
    val = re.findall(r"val_loss ([0-9.]+)", run.stdout + run.stderr)
    record("main job", wall_s=wall, loss=loss, val_loss=float(val[-1]) if val else None,
           tokens_per_s=tokens, mfu_percent=mfu)
    assert loss < 6.0  # from ln 50257 = 10.8; the CPU's run ends at 5.41


def test_moe_experts_run_grouped_under_bf16_autocast():
    """A Mixtral MoE layer under bf16 autocast on the GPU (fp32 master weights: the routed rows
    reach the experts in fp32) runs its experts as `torch._grouped_mm`, not the loop, and its
    output and gradients track the loop's (bf16: 2e-2 relative)."""
    from unittest import mock

    from megapar.mesh import Layout, Mesh
    from megapar.models.moe import MoE, grouped_dtype
    from megapar.models.moe_config import MixtralConfig

    config = MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=32,
                           num_hidden_layers=1, num_attention_heads=4, num_local_experts=4,
                           num_experts_per_tok=2)
    torch.manual_seed(0)
    layer = MoE(config, Mesh.virtual(Layout(1, 1, 1), rank=0, device=GPU.type)).to(GPU)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(2, SEQ, 64, device=GPU)
    runs, calls = [], []
    for grouped in (True, False):
        layer.zero_grad(set_to_none=True)
        rows = x.clone().requires_grad_()
        real = torch._grouped_mm if hasattr(torch, "_grouped_mm") else None

        def counted(*args, **kwargs):
            calls.append(grouped)
            return real(*args, **kwargs)

        choose = grouped_dtype if grouped else (lambda x, size: None)
        with mock.patch("megapar.models.moe.grouped_dtype", choose), \
                mock.patch.object(torch, "_grouped_mm", counted, create=True), \
                torch.autocast(GPU.type, dtype=torch.bfloat16):
            out = layer(rows)
            out = out[0] if isinstance(out, tuple) else out
            out.float().square().mean().backward()
        runs.append((out.float(), rows.grad, layer.experts.gate_up.grad, layer.experts.down.grad))
    if on_cuda():
        assert calls and all(calls), "the experts did not run as grouped matmuls under autocast"
    for a, b in zip(*runs):
        assert rel_err(a, b) < 2e-2
