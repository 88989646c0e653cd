"""DTensor sharding rules and vocabulary-parallel losses, on 2 and 4 CPU processes (gloo).

One spawned group per world size runs every check and reports each by id; the tests below read
those reports. Every kernel runs on the reference backend, float64, once per strategy of its rule
(each spec's `kpt.KernelSpec.sharding`): inputs distributed as the strategy places them, outputs and input
gradients compared with the single-process call on the same inputs, the forward checked to
communicate nothing and to leave its outputs placed as the strategy says.
"""

from __future__ import annotations

import faulthandler
import json
import os
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import kpt

WORLD_SIZES = (2, 4)
TOL = {"rtol": 1e-9, "atol": 1e-9}


# -- the checks, run in every rank ------------------------------------------------------------


def _close(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    if got.shape != want.shape:
        raise AssertionError(f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}")
    if want.is_floating_point():
        torch.testing.assert_close(got, want, **TOL, equal_nan=False, msg=lambda m: f"{name}: {m}")
    elif not torch.equal(got, want):
        raise AssertionError(f"{name}: values differ")


def _distribute(t: torch.Tensor, mesh: Any, placements: list[Any]) -> Any:
    """Every rank drew the same tensor: each takes its shard, no broadcast (gloo has no float8)."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(t, mesh, placements, src_data_rank=None)


def _compare(name: str, got: Any, want: torch.Tensor, mesh: Any) -> None:
    """``got`` (a DTensor) against the single-process ``want``: this rank's share of it, or the
    whole for a partial sum; float8 values as float64 (gloo cannot move float8)."""
    from torch.distributed.tensor import Partial

    if any(isinstance(p, Partial) for p in got.placements):
        _close(name, got.full_tensor(), want.detach())
        return
    share = _distribute(want.detach(), mesh, list(got.placements)).to_local()
    if want.dtype.itemsize == 1 and want.is_floating_point():
        share, got = share.double(), got.to_local().double()
    else:
        got = got.to_local()
    _close(name, got, share)


def _full(t: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _bias(args: dict[str, Any]) -> dict[str, Any]:
    w = args["weight"]
    return {"bias": torch.randn(w.shape[0], generator=torch.Generator().manual_seed(6), dtype=w.dtype)}


VARIANTS: dict[str, list[Callable[[dict[str, Any]], dict[str, Any]]]] = {
    "linear": [lambda a: {}, _bias, lambda a: {"activation": "gelu", **_bias(a)}],
    "attention": [lambda a: {}, lambda a: {"causal": True}],
    "cross_entropy": [lambda a: {"reduction": "none"}, lambda a: {"reduction": "sum", "label_smoothing": 0.1}],
    "linear_cross_entropy": [lambda a: {"reduction": "none"}, lambda a: {"reduction": "sum", **_bias(a)}],
    "quantize_fp8": [lambda a: {"granularity": "row"}],
}
"""Arguments that change a kernel's rule, over its first conformance case's (one variant if absent)."""


def _case_inputs(spec: kpt.KernelSpec) -> list[dict[str, Any]]:
    case = next(c for c in spec.cases() if not c.device_only)
    dtype = torch.float64 if case.dtypes is None or torch.float64 in case.dtypes else case.dtypes[0]
    args = case.make(torch.Generator().manual_seed(0), dtype)
    return [{**args, **variant(args)} for variant in VARIANTS.get(spec.name, [lambda a: {}])]


def _rule_strategies(spec: kpt.KernelSpec, args: dict[str, Any], mesh: Any) -> list[Any]:
    from torch.distributed.tensor import Replicate

    from kpt import distributed

    checked = spec.check((), dict(args), kpt.get_backend("reference").dtypes)
    values = dict(zip(distributed._names(spec), spec.forward_values(checked, True)))
    specs = {n: _distribute(v, mesh, [Replicate()])._spec if isinstance(v, torch.Tensor) else v
             for n, v in values.items()}
    return distributed.forward_strategies(spec, specs)


def _check_strategy(be: kpt.Backend, spec: kpt.KernelSpec, args: dict[str, Any], strategy: Any, mesh: Any) -> None:
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor.debug import CommDebugMode

    if strategy is None:
        _rule_strategies(spec, args, mesh)  # raises what the rule raised
    outputs, inputs = strategy
    grads_of = [n for n in spec.differentiable if isinstance(args.get(n), torch.Tensor)]
    plain = {n: v.clone().requires_grad_(n in grads_of) if isinstance(v, torch.Tensor) else v for n, v in args.items()}
    want = be.call(spec.name, **plain)
    want = want if isinstance(want, tuple) else (want,)
    sharded = {}
    for n, v in args.items():
        if isinstance(v, torch.Tensor):
            p = inputs.get(n, Replicate())
            d = _distribute(v, mesh, [Replicate() if isinstance(p, Partial) else p])
            sharded[n] = d.detach().requires_grad_(n in grads_of)
        else:
            sharded[n] = v
    with CommDebugMode() as comm:
        got = be.call(spec.name, **sharded)
    got = got if isinstance(got, tuple) else (got,)
    # DTensor drops a strategy whose shards are uneven (it gathers them and runs another): the
    # placements and the absence of communication are the rule's only where shards are even
    even = all(v.shape[p.dim] % mesh.size() == 0 for n, v in args.items()
               if isinstance(v, torch.Tensor) and isinstance(p := inputs.get(n), Shard))
    if even and comm.get_total_counts():
        raise AssertionError(f"forward communicated: {comm.get_comm_counts()}")
    for name, g, w in zip(spec.outputs, got, want):
        if not isinstance(g, DTensor):
            raise AssertionError(f"output {name} is a {type(g).__name__}, not a DTensor")
        if even and tuple(g.placements) != (outputs.get(name, Replicate()),):
            raise AssertionError(f"output {name} placed {g.placements}, rule says {outputs.get(name, Replicate())}")
        _compare(name, g, w, mesh)
    if not grads_of:
        return
    cotangents = [torch.randn(w.shape, generator=torch.Generator().manual_seed(1), dtype=w.dtype)
                  for w in want if w.is_floating_point()]
    floats = [i for i, w in enumerate(want) if w.is_floating_point()]
    want_grads = torch.autograd.grad([want[i] for i in floats], [plain[n] for n in grads_of], cotangents)
    dcot = [_distribute(c, mesh, [Replicate()]) for c in cotangents]
    got_grads = torch.autograd.grad([got[i] for i in floats], [sharded[n] for n in grads_of], dcot)
    for n, g, w in zip(grads_of, got_grads, want_grads):
        _compare(f"d{n}", g, w, mesh)


def _expect_error(fn: Callable[[], Any], *words: str) -> None:
    try:
        fn()
    except kpt.KernelNotSupportedError as exc:
        missing = [w for w in words if w not in str(exc)]
        if missing:
            raise AssertionError(f"error does not name {missing}: {exc}") from None
        return
    raise AssertionError("no KernelNotSupportedError")


def _checks(world: int, mesh: Any) -> dict[str, Callable[[], None]]:
    """Every check of one rank, by test id."""
    from torch.distributed.tensor import Replicate, Shard

    be = kpt.get_backend("reference")
    checks: dict[str, Callable[[], None]] = {}
    for name, spec in kpt.SPECS.items():
        for v, args in enumerate(_case_inputs(spec)):
            try:
                strategies = _rule_strategies(spec, args, mesh)
            except Exception:
                strategies = [None]
            for i, strategy in enumerate(strategies):
                checks[f"{name}[{v}.{i}]"] = lambda s=spec, a=args, st=strategy: _check_strategy(be, s, a, st, mesh)

    def shard(t: torch.Tensor, *placements: Any) -> Any:
        return _distribute(t, mesh, list(placements))

    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 8, 16, generator=g, dtype=torch.float64)
    checks["error:rms_norm_hidden_sharded"] = lambda: _expect_error(
        lambda: be.rms_norm(shard(x, Shard(2)), None), "rms_norm", "'x'", "Shard(dim=2)")
    logits = torch.randn(8, 12, generator=g, dtype=torch.float64)
    target = torch.randint(0, 12, (8,), generator=g)
    checks["error:cross_entropy_vocab_sharded"] = lambda: _expect_error(
        lambda: be.cross_entropy(shard(logits, Shard(1)), shard(target, Replicate())),
        "cross_entropy", "'logits'", "kpt.distributed.cross_entropy")
    checks["error:cross_entropy_mean_over_rows"] = lambda: _expect_error(
        lambda: be.cross_entropy(shard(logits, Shard(0)), shard(target, Shard(0))), "cross_entropy", "Shard(dim=0)")
    q = torch.randn(1, 4, 8, 16, generator=g, dtype=torch.float64)
    checks["error:attention_causal_queries"] = lambda: _expect_error(
        lambda: be.attention(shard(q, Shard(2)), shard(q, Replicate()), shard(q, Replicate()), causal=True),
        "attention", "'q'", "Shard(dim=2)")
    checks["error:attention_heads_not_divisible"] = lambda: _expect_error(
        lambda: be.attention(*(shard(torch.randn(1, 3 * world + 1, 8, 16, dtype=torch.float64), Shard(1))
                               for _ in range(3))), "attention", "multiples")
    checks["error:quantize_fp8_tensor_scale"] = lambda: _expect_error(
        lambda: be.quantize_fp8(shard(x.float(), Shard(0)), "tensor"), "quantize_fp8", "'x'")
    checks["plain_tensors_replicated"] = lambda: _check_plain_replicated(be, mesh)
    checks["vocab_parallel_cross_entropy"] = lambda: _check_vocab_parallel(be, mesh)
    checks["vocab_parallel_linear_cross_entropy"] = lambda: _check_vocab_parallel_linear(be, mesh)
    if world == 2:  # one compile is enough (and takes longer than every other check together)
        checks["compiled_rms_norm"] = lambda: _check_compiled(be, mesh)
    return checks


def _check_plain_replicated(be: kpt.Backend, mesh: Any) -> None:
    """Plain tensors beside a DTensor count as replicated: a norm's weight (its gradient reduced
    over the shards), a loss's targets."""
    from torch.distributed.tensor import Shard

    g = torch.Generator().manual_seed(7)
    x = torch.randn(8, 6, 32, generator=g, dtype=torch.float64)
    w = torch.randn(32, generator=g, dtype=torch.float64)
    logits = torch.randn(8, 12, generator=g, dtype=torch.float64)
    target = torch.randint(0, 12, (8,), generator=g)
    dx, w1, w2 = _distribute(x, mesh, [Shard(0)]), w.clone().requires_grad_(), w.clone().requires_grad_()
    y = be.rms_norm(dx, w1)
    _compare("y", y, be.rms_norm(x, w), mesh)
    (got,) = torch.autograd.grad(y.sum(), w1)
    (want,) = torch.autograd.grad(be.rms_norm(x, w2).sum(), w2)
    _close("dweight", got, want)
    loss = be.cross_entropy(_distribute(logits, mesh, [Shard(0)]), target, reduction="sum")
    _close("loss", loss.full_tensor(), be.cross_entropy(logits, target, reduction="sum"))


def _check_vocab_parallel(be: kpt.Backend, mesh: Any) -> None:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.debug import CommDebugMode

    from kpt import distributed

    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float64, torch.float32):
        for reduction in ("mean", "sum", "none"):
            for smoothing in (0.0, 0.1):
                logits = torch.randn(13, 1001, generator=g, dtype=dtype) * 3  # 1001: uneven shards
                target = torch.randint(0, 1001, (13,), generator=g)
                target[[2, 7]] = -100
                plain = logits.clone().requires_grad_()
                want = be.cross_entropy(plain, target, label_smoothing=smoothing, reduction=reduction)
                sharded = _distribute(logits, mesh, [Shard(1)]).requires_grad_()
                with CommDebugMode() as comm:
                    got = distributed.cross_entropy(sharded, target, label_smoothing=smoothing, reduction=reduction)
                if comm.get_total_counts() != 1:
                    raise AssertionError(f"expected one all-reduce, got {comm.get_comm_counts()}")
                if tuple(got.placements) != (Replicate(),):
                    raise AssertionError(f"loss placed {got.placements}")
                tol = TOL if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-6}
                case = f"{dtype} {reduction} smoothing={smoothing}"
                torch.testing.assert_close(got.to_local(), want, **tol, msg=lambda m, c=case: f"loss {c}: {m}")
                cot = torch.randn(want.shape, generator=g, dtype=dtype)
                (dwant,) = torch.autograd.grad(want, plain, cot)
                with CommDebugMode() as comm:
                    (dgot,) = torch.autograd.grad(got, sharded, _distribute(cot, mesh, [Replicate()]))
                if comm.get_total_counts():
                    raise AssertionError(f"backward communicated: {comm.get_comm_counts()}")
                if tuple(dgot.placements) != (Shard(1),):
                    raise AssertionError(f"dlogits placed {dgot.placements}")
                torch.testing.assert_close(dgot.full_tensor(), dwant, **tol, msg=lambda m, c=case: f"dlogits {c}: {m}")


def _check_vocab_parallel_linear(be: kpt.Backend, mesh: Any) -> None:
    from torch.distributed.tensor import Shard

    from kpt import distributed

    g = torch.Generator().manual_seed(4)
    for reduction in ("mean", "sum", "none"):
        hidden = torch.randn(11, 24, generator=g, dtype=torch.float64)
        weight = torch.randn(301, 24, generator=g, dtype=torch.float64)
        bias = torch.randn(301, generator=g, dtype=torch.float64)
        target = torch.randint(0, 301, (11,), generator=g)
        target[3] = -100
        ph, pw, pb = (t.clone().requires_grad_() for t in (hidden, weight, bias))
        want = be.linear_cross_entropy(ph, pw, target, pb, reduction=reduction)
        sh = hidden.clone().requires_grad_()
        sw, sb = (_distribute(t, mesh, [Shard(0)]).requires_grad_() for t in (weight, bias))
        got = distributed.linear_cross_entropy(sh, sw, target, sb, reduction=reduction)
        _close(f"loss {reduction}", got.to_local(), want)
        cot = torch.randn(want.shape, generator=g, dtype=torch.float64)
        dwant = torch.autograd.grad(want, (ph, pw, pb), cot)
        dgot = torch.autograd.grad(got.to_local(), (sh, sw, sb), cot)
        for name, d, w in zip(("dhidden", "dweight", "dbias"), dgot, dwant):
            _close(f"{name} {reduction}", _full(d), w)


def _check_compiled(be: kpt.Backend, mesh: Any) -> None:
    from torch.distributed.tensor import Replicate, Shard

    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 6, 32, generator=g, dtype=torch.float64)
    w = torch.randn(32, generator=g, dtype=torch.float64)
    dx = _distribute(x, mesh, [Shard(1)]).requires_grad_()
    dw = _distribute(w, mesh, [Replicate()])
    fn = torch.compile(lambda a, b: be.rms_norm(a, b), backend="aot_eager", fullgraph=True)
    y = fn(dx, dw)
    if tuple(y.placements) != (Shard(1),):
        raise AssertionError(f"compiled output placed {y.placements}")
    _close("compiled y", y.full_tensor(), be.rms_norm(x, w))
    (gx,) = torch.autograd.grad(y.sum(), dx)
    xr = x.clone().requires_grad_()
    _close("compiled dx", gx.full_tensor(), torch.autograd.grad(be.rms_norm(xr, w).sum(), xr)[0])


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    faulthandler.enable()  # a crash prints each thread's Python stack to the test's stderr
    torch.set_num_threads(1)
    os.environ["KPT_CHECK_INDICES"] = "0"
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    results: dict[str, str] = {}
    for test_id, check in _checks(world, mesh).items():
        try:
            check()
            results[test_id] = ""
        except Exception:
            results[test_id] = traceback.format_exc(limit=6)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    # no rank tears its connections down while another may still read from them: gloo aborts the
    # process (SIGABRT) on a peer that closed mid-transfer
    dist.barrier()
    dist.destroy_process_group()


# -- the tests ---------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"{w}ranks")
def reports(request: pytest.FixtureRequest) -> dict[str, list[str]]:
    """Every check's failures across ranks, by test id, for one world size."""
    world = request.param
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(world, os.path.join(tmp, "init"), tmp), nprocs=world, join=True)
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]
    return {test_id: [f"rank {r}: {ranks[r][test_id]}" for r in range(world) if ranks[r][test_id]]
            for test_id in ranks[0]}


def test_every_kernel_has_a_rule() -> None:
    assert [name for name, spec in kpt.SPECS.items() if spec.sharding is kpt.spec.no_sharding] == []


TORCH_2_11_MESH = ("rope", "cross_entropy")
"""Kernels whose backward op has no tensor first argument (rope's q, cross_entropy's logits are not
kept for it): torch 2.11's DTensor looks for the device mesh in the first argument only and fails
("Cannot find device mesh from args"); torch 2.13 finds it in any. Seen on torch 2.11.0, CPU, gloo."""


def _sharding_marks(kernel: str) -> list:
    if kernel in TORCH_2_11_MESH and torch.torch_version.TorchVersion(torch.__version__) < (2, 13):
        why = ("the backward op's first argument is not a tensor: torch < 2.13's DTensor finds no device mesh "
               "(kpt.distributed needs torch 2.13 for this kernel's backward on DTensors)")
        return [pytest.mark.xfail(strict=True, reason=why)]
    return []


@pytest.mark.parametrize("kernel", [pytest.param(k, marks=_sharding_marks(k)) for k in kpt.SPECS])
def test_sharding_rules(reports: dict[str, list[str]], kernel: str) -> None:
    ran = [t for t in reports if t.startswith(f"{kernel}[")]
    assert ran or kernel in ("quantize_fp8",), f"no strategy of {kernel} ran"
    failures = [f"{t}:\n" + "\n".join(reports[t]) for t in ran if reports[t]]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("check", ["error:rms_norm_hidden_sharded", "error:cross_entropy_vocab_sharded",
                                   "error:cross_entropy_mean_over_rows", "error:attention_causal_queries",
                                   "error:attention_heads_not_divisible", "error:quantize_fp8_tensor_scale",
                                   "plain_tensors_replicated", "vocab_parallel_cross_entropy",
                                   "vocab_parallel_linear_cross_entropy"])
def test_distributed_checks(reports: dict[str, list[str]], check: str) -> None:
    assert not reports[check], "\n".join(reports[check])


@pytest.mark.parametrize("reports", [2], indirect=True, ids=["2ranks"])
def test_compiled_sharded_call(reports: dict[str, list[str]]) -> None:
    """``torch.compile(fullgraph=True)`` of a kpt call on a sequence-sharded DTensor: no graph
    break, the output stays sharded, forward and backward match the single-process call."""
    assert not reports["compiled_rms_norm"], "\n".join(reports["compiled_rms_norm"])
