from __future__ import annotations

import functools

import pytest
import torch

from conftest import check_kernel, device, seeded, to64
from kpt.kernels.cross_entropy import linear_cross_entropy_loss_rounded
from kpt.spec import randn, strided
from kpt.testing import to_device
from kpt_triton import cross_entropy as k

pytestmark = pytest.mark.interpreter  # launches Triton kernels (interpreted on a CPU machine)


def _targets(g, n, v, ignored, ignore_index=-100):
    t = torch.randint(0, max(v, 1), (n,), generator=g)
    return t.masked_fill(torch.rand(n, generator=g) < (ignored if v else 1.0), ignore_index)


def _ce(g, dtype, n, v, *, reduction="mean", smoothing=0.0, ignored=0.2, ignore_index=-100, scale=1.0,
        layout=lambda t: t, masked=0):
    """``masked``: the first columns of every row are −inf (a masked head of the vocabulary), and
    the targets lie after them."""
    logits = layout(randn(g, n, v, dtype=dtype, scale=scale))
    logits[:, :masked] = -float("inf")
    target = _targets(g, n, v - masked, ignored, ignore_index)
    target = torch.where(target == ignore_index, target, target + masked)
    return {"logits": logits, "target": target,
            "ignore_index": ignore_index, "label_smoothing": smoothing, "reduction": reduction}


CE_CASES = {
    "mean": dict(n=7, v=37),
    "sum": dict(n=5, v=19, reduction="sum"),
    "none": dict(n=6, v=50, reduction="none"),
    "smoothing": dict(n=5, v=33, smoothing=0.1),
    "smoothing_none": dict(n=3, v=70, smoothing=0.2, reduction="none"),
    "ignore_class_0": dict(n=9, v=5, ignore_index=0, ignored=0.0),
    "all_ignored": dict(n=4, v=10, ignored=1.0),
    "huge": dict(n=4, v=64, scale=1e4),
    "strided": dict(n=5, v=24, layout=strided),
    "transposed": dict(n=13, v=9, layout=lambda t: t.t().contiguous().t()),
    "zero_rows": dict(n=0, v=16, reduction="sum"),
    "zero_classes": dict(n=3, v=0),
    "single": dict(n=1, v=1, ignored=0.0),
    # fewer rows than multiprocessors (CPU cores here): each row cut into spans across programs
    "one_row": dict(n=1, v=3000, ignored=0.0),
    "one_row_smoothing": dict(n=1, v=2500, smoothing=0.1, ignored=0.0, reduction="none"),
    # whole leading chunks (and spans) of −inf: their sums must stay 0, not exp(−inf + inf) = NaN
    "masked_head": dict(n=3, v=40, masked=20),
    "masked_head_one_row": dict(n=1, v=3000, masked=2100, ignored=0.0),
    # rows 8 elements wider than the vocabulary: logits and gradient rows start alike within a
    # 16-byte vector (aligned reads, `kpt_triton.tiling.row_vector`); 9 wider: they do not
    "row_stride_v_plus_8": dict(n=9, v=203, layout=lambda t: torch.cat([t, t.new_zeros(t.shape[0], 8)], 1)[:, :203]),
    "row_stride_v_plus_9": dict(n=9, v=203, layout=lambda t: torch.cat([t, t.new_zeros(t.shape[0], 9)], 1)[:, :203]),
}


@pytest.mark.parametrize("case", CE_CASES)
@pytest.mark.parametrize("needs_grad", [True, False])
def test_cross_entropy(dtype, case, needs_grad):
    g = seeded(case)
    # small chunks so that the online logsumexp crosses several of them; two programs, so that
    # the persistent loop takes several rows
    fwd = functools.partial(k.cross_entropy_fwd, block_v=16, programs_per_sm=1)
    args = {**_ce(g, dtype, **CE_CASES[case]), "needs_grad": needs_grad}
    check_kernel("cross_entropy", fwd, k.cross_entropy_bwd if needs_grad else None, args, dtype,
                 compare_saved=("dlogits",) if needs_grad else ())


@pytest.mark.parametrize("needs_grad", [True, False])
def test_large_logits_lose_no_precision_to_the_log_sum_exp(needs_grad):
    """Logits near ±1e4 whose largest two lie within a few units: the loss of a row whose target is
    its maximum is about log 2, and the probabilities of those two are about 1/2. A float32
    log-sum-exp there is 2^-11 off (half an ulp of 1e4), 1e-3 of that loss and of those
    probabilities; the kernel subtracts the maximum and log Σ exp apart, exactly enough."""
    g = torch.Generator().manual_seed(3)
    n, v = 6, 40
    logits = (torch.rand(n, v, generator=g) * 2 - 1) * 1e4
    top = logits.argmax(1)
    peak = logits[torch.arange(n), top]
    logits[:, 0] = peak - torch.rand(n, generator=g) * 2  # the runner-up, within 2 of the maximum
    target = torch.where(torch.arange(n) % 2 == 0, top, torch.zeros(n, dtype=torch.long))
    args = {"logits": logits, "target": target, "ignore_index": -100, "label_smoothing": 0.0,
            "reduction": "none", "needs_grad": needs_grad}
    fwd = functools.partial(k.cross_entropy_fwd, block_v=16, programs_per_sm=1)
    check_kernel("cross_entropy", fwd, k.cross_entropy_bwd if needs_grad else None, args, torch.float32,
                 compare_saved=("dlogits",) if needs_grad else ())


@pytest.mark.parametrize("factor", ["one", "shared", "per_row"])
def test_scale_rows_in_place(factor):
    g = torch.Generator().manual_seed(5)
    x = randn(g, 6, 37, dtype=torch.bfloat16).to(device())
    before = x.clone()
    f = {"one": torch.ones(()), "shared": torch.tensor(-0.3), "per_row": randn(g, 6, dtype=torch.float32)}[factor]
    out = k.scale_rows_(x, f.to(device()), block=16, programs_per_sm=1)
    assert out is x
    expected = before.float() * (f[:, None] if f.dim() else f).to(device())
    # one bfloat16 rounding of the float32 product (the interpreter's conversion truncates: 2^-7)
    torch.testing.assert_close(x.float(), expected, rtol=2**-7, atol=0)
    if factor == "one":
        assert torch.equal(x, before)


def test_out_of_range_target_is_nan():
    args = _ce(torch.Generator().manual_seed(1), torch.float32, 3, 8, ignored=0.0, reduction="none")
    args["target"][1] = 8
    args = to_device(args, device())
    loss, _ = k.cross_entropy_fwd(*args.values(), False)
    assert loss[1].isnan() and not loss[0].isnan() and not loss[2].isnan()


def _lce(g, dtype, n, kdim, v, *, reduction="mean", bias=None, ignored=0.2, scale=1.0, layout=lambda t: t):
    return {
        "hidden": layout(randn(g, n, kdim, dtype=dtype, scale=scale)),
        "weight": layout(randn(g, v, kdim, dtype=dtype, scale=max(kdim, 1) ** -0.5)),
        "target": _targets(g, n, v, ignored),
        "bias": randn(g, v, dtype=dtype if bias is True else bias) if bias else None,
        "ignore_index": -100,
        "reduction": reduction,
    }


LCE_CASES = {
    "mean": dict(n=9, kdim=16, v=40),
    "sum_bias": dict(n=7, kdim=8, v=33, reduction="sum", bias=True),
    "none_bias": dict(n=7, kdim=8, v=33, reduction="none", bias=True),
    "fp32_bias": dict(n=6, kdim=8, v=20, bias=torch.float32),
    "strided": dict(n=5, kdim=12, v=17, layout=strided),
    "transposed": dict(n=5, kdim=12, v=17, layout=lambda t: t.t().contiguous().t()),
    "all_ignored": dict(n=4, kdim=8, v=10, ignored=1.0),
    # logits near ±300, beyond exp's float32 range without the maximum subtracted; in 16 bits they are
    # off by whole units once rounded as linear returns them, which the contract's allowance bounds
    # (`kpt.kernels.cross_entropy.linear_cross_entropy_rounded`, and `linear_cross_entropy_loss_rounded`
    # for the loss: 10 seeds in 20,000 moved a loss whose kept targets are near their row's largest
    # logit beyond the relative tolerance, one of them in CI). In float32 itself logits of 1e3
    # carry errors of 6e-5 that exp turns into gradient errors above float32's tolerance whatever
    # the kernel.
    "huge": dict(n=4, kdim=16, v=64, scale=100.0),
    "zero_rows": dict(n=0, kdim=8, v=10),
    "zero_hidden": dict(n=3, kdim=0, v=10, reduction="sum"),
    "single": dict(n=1, kdim=1, v=1, ignored=0.0),
}


@pytest.mark.parametrize("needs_grad", [True, False], ids=["fused", "recompute"])
@pytest.mark.parametrize("case", LCE_CASES)
def test_linear_cross_entropy(dtype, case, needs_grad):
    if dtype == torch.float32 and LCE_CASES[case].get("bias") is torch.float32:
        pytest.skip("a 16-bit case")
    g = seeded(case)
    args = {**_lce(g, dtype, **LCE_CASES[case]), "needs_grad": needs_grad}
    # a few rows per chunk: every chunk boundary of the row loop is crossed
    kw = {"chunk_elems": 3 * max(args["weight"].shape[0], 1), "block_v": 16}
    loss_moved = linear_cross_entropy_loss_rounded({n: to64(v) for n, v in args.items()}, dtype)
    check_kernel("linear_cross_entropy", lambda *a: k.linear_cross_entropy_fwd(*a, **kw),
                 lambda *a: k.linear_cross_entropy_bwd(*a, **kw), args, dtype, output_allowances={"loss": loss_moved})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_linear_cross_entropy_an_inf_reaches_only_its_own_row(dtype):
    """An inf in one row's hidden state makes that row's loss and gradient NaN, and no other row's
    (a fuzzed call, 2026-12-05: through Triton's interpreter the 16-bit CPU GEMM of dz and the
    weight let row 12's NaN reach row 11)."""
    g = torch.Generator().manual_seed(0)
    hidden = randn(g, 17, 31, dtype=dtype)
    hidden[12, 4], hidden[12, 5] = float("inf"), float("-inf")
    weight, target = randn(g, 31, 31, dtype=dtype), torch.randint(0, 31, (17,), generator=g)
    dloss = torch.rand(17, generator=g)
    hidden, weight, target, dloss = (t.to(device()) for t in (hidden, weight, target, dloss))
    loss, _, _, _, lse = k.linear_cross_entropy_fwd(hidden, weight, target, None, -100, "none", False)
    dhidden, _, _ = k.linear_cross_entropy_bwd(hidden, weight, target, None, -100, "none", False, loss, None, None,
                                               None, lse, dloss)
    assert loss.isnan().nonzero().flatten().tolist() == [12]
    assert dhidden.isnan().any(1).nonzero().flatten().tolist() == [12]


class _GpuTensor:
    """What `chunk_rows` asks of ``hidden`` on a GPU."""

    is_cuda, device = True, "cuda:0"

    def __init__(self, dtype):
        self.dtype = dtype

    def element_size(self):
        return torch.tensor([], dtype=self.dtype).element_size()


def _allocator(monkeypatch, allocated, reserved):
    """torch's allocator statistics on a GPU (their nested form, which `chunk_rows` reads): the bytes
    ``allocated()`` and ``reserved()`` give at each read."""

    def stats(device):
        bytes_of = {"allocated": allocated(), "reserved": reserved()}
        return {f"{kind}_bytes": {pool: {"current": n if pool == "all" else 0, "peak": 3 * n + 1}
                                  for pool in ("all", "small_pool", "large_pool")} for kind, n in bytes_of.items()}

    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", stats)


def test_chunks_take_no_more_room_than_the_gradients():
    """A chunk's logits take at most the room of the gradients the loss returns ([n, k] and
    [v, k]), so its peak above the inputs stays within twice those (any fused loss allocates them)."""
    bf16 = torch.empty(0, dtype=torch.bfloat16)
    assert k.chunk_rows(16384, 768, 151936, bf16, 1 << 28) == 768  # Qwen3's head: 851 rows, cut to tiles
    assert k.chunk_rows(16384, 768, 151936, bf16, 1 << 28, gradient_share=float("inf")) == 1664  # 2^28 logits
    assert k.chunk_rows(16384, 768, 32000, bf16, 1 << 28) == 1152  # a 125M Llama's head: 1161 rows
    assert k.chunk_rows(8192, 4096, 128256, bf16, 1 << 28) == 2048  # Llama 3's: 2^28 logits are less
    assert k.chunk_rows(1000, 8, 50000, bf16, 1 << 28) == 128  # never fewer than one tile of rows
    for n, hidden, v in ((16384, 768, 151936), (16384, 768, 32000), (8192, 4096, 128256), (4096, 2048, 256000)):
        assert k.chunk_rows(n, hidden, v, bf16, 1 << 28) * v <= (n + v) * hidden


@pytest.mark.parametrize("capturing", [False, True])
def test_chunks_fit_in_a_quarter_of_the_free_memory(monkeypatch, capturing):
    v, gib = 128256, 2**30
    free = {"driver": 64 * gib, "cached": 0, "asked": 0}

    def mem_get_info(device):
        free["asked"] += 1
        return free["driver"], 80 * gib

    monkeypatch.setattr(k, "_HOLDABLE", {})
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    _allocator(monkeypatch, lambda: gib, lambda: free["cached"] + gib)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing)
    bf16, f32 = _GpuTensor(torch.bfloat16), _GpuTensor(torch.float32)
    # the tuning's 2^28 logits: 2093 rows, cut to whole tiles of 128
    assert k.chunk_rows(8192, 4096, v, bf16, 1 << 28) == 2048
    assert k.chunk_rows(300, 4096, v, bf16, 1 << 28) == 256  # no more rows than there are
    # the driver is asked once, not at every loss (where memory is plenty)
    assert free["asked"] == (0 if capturing else 1)
    free["driver"] = 1 * gib  # taken by another process: not seen until memory looks short
    assert k.chunk_rows(8192, 4096, v, bf16, 1 << 28) == 2048
    k._HOLDABLE.clear()  # as in a new process: 2 bytes a logit, 2048 rows take 0.49 GiB > 1 GiB / 4
    assert k.chunk_rows(8192, 4096, v, bf16, 1 << 28) == (2048 if capturing else 1024)
    assert k.chunk_rows(8192, 4096, v, f32, 1 << 28) == (2048 if capturing else 512)  # 4 bytes a logit
    free["cached"] = 1 * gib  # memory torch's allocator holds unused counts as free
    assert k.chunk_rows(8192, 4096, v, f32, 1 << 28) == (2048 if capturing else 1024)
    free["driver"], free["cached"] = 10 * 2**20, 0  # 10 MiB: a few rows, whatever it costs in time
    k._HOLDABLE.clear()
    assert k.chunk_rows(8192, 4096, v, bf16, 1 << 28) == (2048 if capturing else 8)
    free["driver"] = 0
    k._HOLDABLE.clear()
    assert k.chunk_rows(8192, 4096, v, bf16, 1 << 28) == (2048 if capturing else 1)


def test_chunks_shrink_when_torch_holds_more_since_the_driver_was_asked(monkeypatch):
    """Memory torch allocates after the driver was asked counts without asking again; where the
    chunk then looks too large, the driver is asked again before the chunk is cut."""
    v, gib = 128256, 2**30
    state = {"allocated": gib, "asked": 0}

    def mem_get_info(device):
        state["asked"] += 1
        return 3 * gib, 80 * gib

    monkeypatch.setattr(k, "_HOLDABLE", {})
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    _allocator(monkeypatch, lambda: state["allocated"], lambda: gib)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    bf16 = _GpuTensor(torch.bfloat16)
    assert k.chunk_rows(8192, 4096, v, bf16, 1 << 28) == 2048  # 3 GiB free: 2048 rows (0.49 GiB) fit 4 times
    state["allocated"] = 5 * gib // 2  # torch took 1.5 GiB more: 1.5 GiB free, 1024 rows fit 4 times
    assert k.chunk_rows(8192, 4096, v, bf16, 1 << 28) == 1024
    assert state["asked"] == 2  # asked again before cutting
