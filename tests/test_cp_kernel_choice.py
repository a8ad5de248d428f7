"""`kernels.choose_kernel` on a CUDA device, without one: which block kernel context
parallelism calls for a head size, dtype and mask.

On a GPU the answer is PyTorch's (`torch.backends.cuda.can_use_flash_attention` /
`can_use_efficient_attention`, asked by `kernels.torch_accepts`); here those checks are
replaced by `_sdp_utils`, the head-size, dtype, alignment and architecture rules of
aten/src/ATen/native/transformers/cuda/sdp_utils.cpp (sdp::can_use_flash_attention,
sdp::can_use_mem_efficient_attention) written out for a chosen compute capability, and the
probe tensors are made on the CPU. What is tested is megapar's part: what it asks torch (grad
enabled, tensors requiring their gradient, no mask, no dropout), what it adds (flash only for
head sizes that are a multiple of 8, only 16-bit, only unmasked) and what it falls back to. The
kernels' numbers at these head sizes on a GPU are tests/test_cuda_single.py's."""

import pytest
import torch

from megapar.context_parallel import kernels
from megapar.context_parallel.kernels import choose_kernel

GPU = torch.device("cuda", 0)
HALF = (torch.float16, torch.bfloat16)


def _sm(capability, low, high) -> bool:
    return low <= capability <= high


class _sdp_utils:
    """PyTorch's SDPA filters for the fused CUDA kernels on a GPU of `capability` (major,
    minor), as sdp_utils.cpp states them for dense inputs; records every SDPAParams asked."""

    def __init__(self, capability):
        self.capability, self.asked = capability, []

    def flash(self, params, debug=False) -> bool:
        self.asked.append(("flash", params, torch.is_grad_enabled()))
        q, k, v = params.query, params.key, params.value
        d = q.shape[-1]
        if not _sm(self.capability, (8, 0), (12, 1)) or q.dtype not in HALF:
            return False
        if params.attn_mask is not None or not (d == k.shape[-1] == v.shape[-1] and d <= 256):
            return False  # check_for_attn_mask, check_head_dim_size_flash
        training = torch.is_grad_enabled() and q.requires_grad
        narrow = _sm(self.capability, (8, 6), (8, 9)) or _sm(self.capability, (12, 0), (12, 1))
        # check_requires_grad_and_head_dim_gt192_constraints_on_sm86_89_or_120
        if training and narrow:
            return d <= 192 or (params.dropout == 0.0 and d > 224)
        return True

    def efficient(self, params, debug=False) -> bool:
        self.asked.append(("efficient", params, torch.is_grad_enabled()))
        q, k, v = params.query, params.key, params.value
        if not _sm(self.capability, (5, 0), (12, 1)):
            return False
        dtypes = (torch.float16, torch.float32) + ((torch.bfloat16,) if self.capability >= (8, 0)
                                                   else ())
        if q.dtype not in dtypes:
            return False
        half = q.dtype in HALF
        # minimum_gemm_alignment: tensor cores from sm80 (sm70 in 16 bits), 128 bits a row
        align = 4 if self.capability >= (8, 0) else 1
        if self.capability >= (8, 0) or (self.capability >= (7, 0) and half):
            align = max(align, 128 // (16 if half else 32))
        d, dv = q.shape[-1], v.shape[-1]  # check_head_dim_size_mem_efficient
        return d == k.shape[-1] and d % align == 0 and dv % align == 0 and d > 0 and dv > 0


@pytest.fixture
def gpu(monkeypatch):
    """Sets the fake GPU's compute capability; returns its `_sdp_utils`."""

    def on(capability):
        sdp = _sdp_utils(capability)
        monkeypatch.setattr(kernels, "_ACCEPTS", {})
        monkeypatch.setattr(kernels, "_probe", lambda device, dtype, d: torch.empty(
            (1, 1, 1, d), dtype=dtype, requires_grad=True))
        monkeypatch.setattr(torch.backends.cuda, "can_use_flash_attention", sdp.flash)
        monkeypatch.setattr(torch.backends.cuda, "can_use_efficient_attention", sdp.efficient)
        return sdp

    return on


H100, A6000, V100 = (9, 0), (8, 6), (7, 0)


@pytest.mark.parametrize("head_dim,bf16,bf16_masked,fp32", [
    (64, "cuda-flash", "cuda-efficient", "cuda-efficient"),
    (128, "cuda-flash", "cuda-efficient", "cuda-efficient"),
    (192, "cuda-flash", "cuda-efficient", "cuda-efficient"),  # DeepSeek-V3's MLA
    (256, "cuda-flash", "cuda-efficient", "cuda-efficient"),
    (264, "cuda-efficient", "cuda-efficient", "cuda-efficient"),  # past flash's 256
    (100, "math", "math", "cuda-efficient"),  # 16 bits: 8 | d for both (fp32: 4 | d)
    (66, "math", "math", "math"),
])
def test_h100_fused_kernel_by_head_size(gpu, head_dim, bf16, bf16_masked, fp32):
    """sm90: flash for unmasked 16-bit blocks up to 256 (a multiple of 8), the memory-efficient
    kernel beyond and for masks and fp32 wherever its alignment holds, else "math"."""
    gpu(H100)
    assert choose_kernel(GPU, 0.0, torch.bfloat16, False, head_dim) == bf16
    assert choose_kernel(GPU, 0.0, torch.float16, False, head_dim) == bf16
    assert choose_kernel(GPU, 0.0, torch.bfloat16, True, head_dim) == bf16_masked
    assert choose_kernel(GPU, 0.0, torch.float32, False, head_dim) == fp32
    assert choose_kernel(GPU, 0.0, torch.float32, True, head_dim) == fp32


@pytest.mark.parametrize("head_dim,bf16", [
    (128, "cuda-flash"), (192, "cuda-flash"), (200, "cuda-efficient"), (224, "cuda-efficient"),
    (232, "cuda-flash"), (256, "cuda-flash"),
])
def test_sm86_flash_backward_limit(gpu, head_dim, bf16):
    """sm86 (A6000, RTX 30xx): flash's backward does not run head sizes 193-224, which torch
    reports only when asked with gradients wanted: those take the memory-efficient kernel."""
    gpu(A6000)
    assert choose_kernel(GPU, 0.0, torch.bfloat16, False, head_dim) == bf16


def test_torch_is_asked_for_training_without_mask_or_dropout_once(gpu):
    """The checks see tensors that require their gradient under grad mode (so the backward's
    limits apply), of the block's dtype and head size for q, k and v, no mask, no dropout, not
    causal; each (kernel, device, dtype, head size) is asked once, also from no_grad code."""
    sdp = gpu(H100)
    with torch.no_grad():
        assert choose_kernel(GPU, 0.0, torch.bfloat16, False, 192) == "cuda-flash"
    assert choose_kernel(GPU, 0.0, torch.bfloat16, False, 192) == "cuda-flash"
    assert choose_kernel(GPU, 0.0, torch.bfloat16, True, 192) == "cuda-efficient"
    assert [a[0] for a in sdp.asked] == ["flash", "efficient"]
    for _, params, grad in sdp.asked:
        assert grad and params.query.requires_grad and params.attn_mask is None
        assert params.dropout == 0.0 and not params.is_causal
        assert params.query.dtype == torch.bfloat16
        assert params.query.shape[-1] == params.key.shape[-1] == params.value.shape[-1] == 192


def test_a_kernel_disabled_after_the_first_choice_is_not_chosen(gpu, monkeypatch):
    """PyTorch's checks refuse a kernel its user disabled (`enable_flash_sdp(False)`:
    check_runtime_disabled_flash in sdp_utils.cpp); the answers kept per process are kept per
    switch too, so a choice made before the switch does not outlive it."""
    sdp = gpu(H100)
    flash = sdp.flash
    monkeypatch.setattr(torch.backends.cuda, "can_use_flash_attention", lambda params, debug:
                        torch.backends.cuda.flash_sdp_enabled() and flash(params, debug))
    was = torch.backends.cuda.flash_sdp_enabled()
    try:
        torch.backends.cuda.enable_flash_sdp(True)
        assert choose_kernel(GPU, 0.0, torch.bfloat16, False, 128) == "cuda-flash"
        torch.backends.cuda.enable_flash_sdp(False)
        assert choose_kernel(GPU, 0.0, torch.bfloat16, False, 128) == "cuda-efficient"
        torch.backends.cuda.enable_flash_sdp(True)
        assert choose_kernel(GPU, 0.0, torch.bfloat16, False, 128) == "cuda-flash"
    finally:
        torch.backends.cuda.enable_flash_sdp(was)


def test_older_gpus_and_dropout(gpu):
    """sm70 (V100): no flash; the memory-efficient kernel in fp16 and fp32 (fp32 without
    tensor cores: any head size), not bf16. Dropout is "math" on every device; a CPU "flash"."""
    gpu(V100)
    assert choose_kernel(GPU, 0.0, torch.float16, False, 192) == "cuda-efficient"
    assert choose_kernel(GPU, 0.0, torch.float32, False, 66) == "cuda-efficient"
    assert choose_kernel(GPU, 0.0, torch.bfloat16, False, 192) == "math"
    assert choose_kernel(GPU, 0.1, torch.float16, False, 64) == "math"
    assert choose_kernel(torch.device("cpu"), 0.0, torch.bfloat16, False, 192) == "flash"
    assert choose_kernel(torch.device("cpu"), 0.1, torch.float32, False, 64) == "math"


def test_a_cpu_build_asked_says_no():
    """torch's own checks on this (CPU) build refuse both fused CUDA kernels: the probe is
    real SDPAParams, the answer PyTorch's."""
    t = torch.empty((1, 1, 1, 192), requires_grad=True)
    params = torch.backends.cuda.SDPAParams(t, t, t, None, 0.0, False, False)
    assert not torch.backends.cuda.can_use_flash_attention(params, False)
    assert not torch.backends.cuda.can_use_efficient_attention(params, False)
