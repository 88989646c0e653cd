"""The Metal emulator: Metal's semantics (threadgroups, barriers, simdgroups), the race check, the
subset it accepts, and that a broken shader of kpt-mps is caught (a race; a numerics failure)."""

from __future__ import annotations

import pytest
import torch
from kpt_mps import metal
from kpt_mps.emulator import BuildError, DispatchError, Library

import kpt
from kpt.testing import check_backward, check_forward

HEADER = "#include <metal_stdlib>\nusing namespace metal;\n"


def lib(body: str) -> Library:
    return Library(HEADER + body, "test.metal")


SIMD = lib("""
kernel void collectives(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                        uint i [[thread_position_in_grid]], uint lane [[thread_index_in_simdgroup]]) {
  float v = x[i];
  out[6 * i + 0] = simd_sum(v);
  out[6 * i + 1] = simd_max(v);
  out[6 * i + 2] = simd_shuffle_xor(v, 1);
  out[6 * i + 3] = simd_shuffle_down(v, 4);
  out[6 * i + 4] = simd_prefix_exclusive_sum(v);
  out[6 * i + 5] = simd_broadcast(v, 3);
}

kernel void reverse(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                    uint lid [[thread_position_in_threadgroup]], uint g [[threadgroup_position_in_grid]],
                    uint n [[threads_per_threadgroup]]) {
  threadgroup float tile[1024];
  tile[lid] = x[g * n + lid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[g * n + lid] = tile[n - 1 - lid];
}

kernel void reverse_racy(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                         uint lid [[thread_position_in_threadgroup]], uint g [[threadgroup_position_in_grid]],
                         uint n [[threads_per_threadgroup]]) {
  threadgroup float tile[1024];
  tile[lid] = x[g * n + lid];
  out[g * n + lid] = tile[n - 1 - lid];
}

kernel void lane_swap(device const float* x [[buffer(0)]], device float* out [[buffer(1)]],
                      uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float tile[64];
  tile[lid] = x[lid];
  simdgroup_barrier(mem_flags::mem_threadgroup);
  out[lid] = tile[lid ^ 1];
}

kernel void early_return(device float* out [[buffer(0)]], uint lid [[thread_position_in_threadgroup]]) {
  if (lid == 5) return;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[lid] = 1.0f;
}

kernel void divergent_simd(device float* out [[buffer(0)]], uint lid [[thread_position_in_threadgroup]]) {
  out[lid] = lid < 16 ? simd_sum(1.0f) : simd_max(1.0f);
}

kernel void out_of_bounds(device float* out [[buffer(0)]], uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float tile[32];
  tile[lid] = 1.0f;
  out[lid] = 0.0f;
}

kernel void matmul(device const float* a [[buffer(0)]], device const float* b [[buffer(1)]],
                   device float* out [[buffer(2)]], uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float tile[64];
  simdgroup_float8x8 ma, mb, mc = make_filled_simdgroup_matrix<float, 8, 8>(1.0f);
  simdgroup_load(ma, a, 8);
  simdgroup_load(mb, b, 8, ulong2(0, 0), true);
  simdgroup_multiply_accumulate(mc, ma, mb, mc);
  simdgroup_store(mc, tile + 0, 8);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[lane] = tile[63 - lane];
  out[32 + lane] = tile[31 - lane];
}

kernel void matmul_racy(device const float* a [[buffer(0)]], device const float* b [[buffer(1)]],
                        device float* out [[buffer(2)]], uint lane [[thread_index_in_simdgroup]]) {
  threadgroup float tile[64];
  simdgroup_float8x8 ma;
  simdgroup_load(ma, a, 8);
  simdgroup_store(ma, tile + 0, 8);
  out[lane] = tile[63 - lane];
}

kernel void matmul_divergent(device const float* a [[buffer(0)]], device const float* b [[buffer(1)]],
                             device float* out [[buffer(2)]], uint lane [[thread_index_in_simdgroup]]) {
  simdgroup_float8x8 m = make_filled_simdgroup_matrix<float, 8, 8>(float(lane));
  simdgroup_multiply_accumulate(m, m, m, m);
  out[lane] = 0.0f;
}

kernel void uninitialized(device float* out [[buffer(0)]], uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float tile[32];
  out[lid] = tile[lid % 32];
}
""")


def test_simdgroup_functions_follow_metal():
    x = torch.randn(64)
    out = torch.empty(64, 6)
    SIMD.dispatch("collectives", [x, out], 64, 64)
    lanes = x.reshape(2, 32)
    i = torch.arange(32)
    torch.testing.assert_close(out[:, 0].reshape(2, 32), lanes.sum(1, keepdim=True).expand(2, 32))
    torch.testing.assert_close(out[:, 1].reshape(2, 32), lanes.amax(1, keepdim=True).expand(2, 32))
    torch.testing.assert_close(out[:, 2].reshape(2, 32), lanes[:, i ^ 1])
    # lanes past the end keep their own value
    torch.testing.assert_close(out[:, 3].reshape(2, 32), lanes[:, torch.where(i + 4 < 32, i + 4, i)])
    torch.testing.assert_close(out[:, 4].reshape(2, 32), lanes.cumsum(1) - lanes)
    torch.testing.assert_close(out[:, 5].reshape(2, 32), lanes[:, 3:4].expand(2, 32))


def test_simdgroup_matrix_product():
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    out = torch.empty(64)
    SIMD.dispatch("matmul", [a, b, out], 32, 32)
    c = (a @ b.T + 1).reshape(64)  # b loaded transposed
    lanes = torch.arange(32)
    torch.testing.assert_close(out, torch.cat([c[63 - lanes], c[31 - lanes]]))


@pytest.mark.parametrize("kernel, message", [
    ("matmul_racy", r"race on tile\[\d+\]: thread \d+ (read|wrote) it and thread \d+ (read|wrote) it"),
    ("matmul_divergent", "lanes 0 and 1 of a simdgroup multiply different matrices"),
])
def test_simdgroup_matrix_misuse_is_an_error(kernel, message):
    with pytest.raises(DispatchError, match=message):
        SIMD.dispatch(kernel, [torch.randn(8, 8), torch.randn(8, 8), torch.empty(64)], 32, 32)


def test_threadgroup_memory_is_shared_within_a_group_after_a_barrier():
    x = torch.randn(3, 1024)
    out = torch.empty(3, 1024)
    SIMD.dispatch("reverse", [x, out], 3 * 1024, 1024)
    torch.testing.assert_close(out, x.flip(1))


def test_a_missing_barrier_is_a_race():
    with pytest.raises(DispatchError, match=r"race on tile\[\d+\]: thread \d+ read it and thread \d+ wrote it"):
        SIMD.dispatch("reverse_racy", [torch.randn(256), torch.empty(256)], 256, 256)


def test_simdgroup_barrier_orders_lanes_of_one_simdgroup():
    x = torch.randn(64)
    out = torch.empty(64)
    SIMD.dispatch("lane_swap", [x, out], 64, 64)
    torch.testing.assert_close(out, x[torch.arange(64) ^ 1])


@pytest.mark.parametrize("kernel, message", [
    ("early_return", r"thread \d+ waits at threadgroup_barrier while thread 5 has returned"),
    ("divergent_simd", r"lanes 0 and 16 of simdgroup 0 wait at different simdgroup functions"),
    ("out_of_bounds", r"tile\[32\] is out of bounds"),
    ("uninitialized", r"read threadgroup memory tile\[0\] that no thread wrote"),
])
def test_undefined_behaviour_is_an_error(kernel, message):
    with pytest.raises(DispatchError, match=message):
        SIMD.dispatch(kernel, [torch.empty(64)], 64, 64)


def test_a_failed_dispatch_leaves_the_emulator_usable():
    with pytest.raises(DispatchError):
        SIMD.dispatch("early_return", [torch.empty(64)], 64, 64)
    test_threadgroup_memory_is_shared_within_a_group_after_a_barrier()


@pytest.mark.parametrize("body, message", [
    ("kernel void f(device float* x [[buffer(0)]]) { x[0] = fast::exp(x[0]); }", "does not compile"),
    ("kernel void f(device float* x [[buffer(0)]], uint2 p [[thread_position_in_grid]]) {}", "must be a scalar uint"),
    ("kernel void f(device float* x [[buffer(0)]], float4 p [[stage_in]]) {}", r"\[\[stage_in\]\] is outside"),
    ("kernel void f(device float* x [[buffer(0)]]) { threadgroup float t[4][4]; }", "threadgroup memory outside"),
    ("kernel void f(device float* x [[buffer(0)]], float y) {}", "has no"),
    ("kernel void f(device float* x [[buffer(0)]]) { x[0] = 1.0f; } [[visible]] void g() {}", "does not compile"),
])
def test_a_shader_outside_the_subset_fails_the_build(body, message):
    with pytest.raises(BuildError, match=message):
        lib(body)


# -- kpt-mps's own shaders, broken on purpose ------------------------------------------------------

def _broken(monkeypatch, old: str, new: str) -> None:
    """kpt-mps with ``old`` replaced by ``new`` in every library's source."""
    original = metal.source

    def source(family: str) -> str:
        text = original(family)
        assert old in text
        return text.replace(old, new, 1)

    monkeypatch.setattr(metal, "source", source)
    metal._library.cache_clear()


def _rms_norm_check():
    g = torch.Generator().manual_seed(0)
    args = {"x": torch.randn(16, 1000, generator=g), "weight": torch.randn(1000, generator=g), "eps": 1e-6}
    return check_forward(kpt.get_backend("mps"), kpt.SPECS["rms_norm"], args, torch.float32)


def test_the_shaders_pass_unbroken(emulated):
    assert _rms_norm_check().ok


def test_a_removed_barrier_in_a_reduction_is_a_reported_race(emulated, monkeypatch):
    write = "  if (lid % 32 == 0) partial[lid / 32] = v;\n"
    _broken(monkeypatch, write + "  threadgroup_barrier(mem_flags::mem_threadgroup);\n", write)
    with pytest.raises(kpt.BackendError, match=r"threadgroup memory race on partial\[\d+\]"):
        _rms_norm_check()


def test_an_off_by_one_in_a_reduction_is_a_numerics_failure(emulated, monkeypatch):
    # the sum over the simdgroups' partials stops one short: the last simdgroup's share is lost
    _broken(monkeypatch, "for (uint s = 0; s < (threads + 31) / 32; ++s) total += partial[s];",
            "for (uint s = 0; s + 1 < (threads + 31) / 32; ++s) total += partial[s];")
    report = _rms_norm_check()
    assert not report.ok and "y" in report.message


def _attention_backward_check():
    # grouped-query (two query heads per key/value head), causal with more keys than queries, and
    # no size a multiple of 8: the tiles' padding and masks are all exercised
    g = torch.Generator().manual_seed(0)
    args = {"q": torch.randn(1, 2, 11, 20, generator=g), "k": torch.randn(1, 1, 13, 20, generator=g),
            "v": torch.randn(1, 1, 13, 20, generator=g), "causal": True, "scale": None}
    return check_backward(kpt.get_backend("mps"), kpt.SPECS["attention"], args, torch.float32, g)


def test_the_tiled_attention_backward_passes_unbroken(emulated):
    assert _attention_backward_check().ok


@pytest.mark.parametrize("barrier, tile", [
    # dq: the lanes combine P and dP into dS while other lanes still load the score tile
    ("  // K and dS are read before the next block", "kvs"),
    # dk, dv: dS overwrites P (and reads dP) with no barrier after the products that read them
    ("  // dP is written and every lane has read dO and P", r"(ss|dps)"),
])
def test_a_removed_barrier_in_the_attention_backward_is_a_reported_race(emulated, monkeypatch, barrier, tile):
    _broken(monkeypatch, "threadgroup_barrier(mem_flags::mem_threadgroup);" + barrier, barrier)
    with pytest.raises(kpt.BackendError, match=rf"threadgroup memory race on {tile}\[\d+\]"):
        _attention_backward_check()


def test_an_off_by_one_in_the_attention_backward_mask_is_a_numerics_failure(emulated, monkeypatch):
    # the backward's causal mask lets each query see one key too many (the forward's mask is its own)
    _broken(monkeypatch, "(!causal || j <= i + skv - sq)", "(!causal || j <= i + skv - sq + 1)")
    report = _attention_backward_check()
    assert not report.ok and "dq" in report.message and "dk" in report.message
