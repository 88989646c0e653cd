"""The sweeps of kpt.bench (real models' sizes, attention, linear products) and `run_sweep`, which
measures one.

A sweep is a list of `Point`s: a kernel, a `Case` whose ``make`` draws the inputs (the kernels'
own input builders, so every input is what the contract expects) and the modes to time.
`run_sweep` draws the inputs on the device itself, so the sizes here are bounded by what eager
PyTorch (the reference math in float32) needs on an 80 GB GPU, not by host memory.

* ``perf``: each kernel's perf shape (its ``perf`` cases; docs/performance.md).
* ``models``: the hidden sizes, MLP widths and vocabularies of Llama 3, Qwen2.5/3, Mistral, Gemma 2
  and a DeepSeek-style MoE (256 experts, top-8), at token counts from 1 to 64K, for every kernel
  whose shape those sizes set. Every model width is timed at 4096 tokens; the Llama 3 widths (the
  first two of each kind) at every count of `TOKENS`.
* ``attention``: the B4 H32 S4096 D128, causal and not, 1K and 16K long, grouped-query
  ratios 4 and 8, head dims 64/128 (forward and backward) and 256 (forward), bf16 and fp16,
  and KV-cache decode (1 and 8 queries against up to 32K keys, 32 query heads, 8 KV heads; 16
  queries against 8K keys, 4 KV heads), and chunked prefill (512 and 4096 queries against 8K and
  16K keys).
* ``linear``: ``linear`` with each activation at the Llama 3 8B MLP (8192×14336×4096 and token
  counts 1..16K), ``fp8_linear`` with row-wise scales, ``grouped_linear`` with 8 to 256 experts
  and uneven token counts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ..backend import Backend
from ..kernels import SPECS
from ..kernels.activations import _make_gated, _make_x
from ..kernels.attention import _make as _make_attention
from ..kernels.cross_entropy import _make_ce, _make_lce
from ..kernels.fp8 import _make_dequantize, _make_fp8_linear, _make_quantize
from ..kernels.layer_norm import _make as _make_layer_norm
from ..kernels.linear import _make as _make_linear
from ..kernels.moe import _make_combine, _make_dispatch, _make_gating, _make_grouped
from ..kernels.rms_norm import _make as _make_rms_norm
from ..kernels.rope import _make as _make_rope
from ..kernels.softmax import _make as _make_softmax
from ..spec import Args, Case
from ..spec import nbytes as nbytes_of
from .host import HostCost, host_cost
from .measure import Measurement, draw_inputs, error_line, measure_args
from .peers import forget_compiled
from .report import row
from .timing import Ceilings

MODES = ("fwd", "fwd+bwd")
FWD = MODES[:1]


@dataclass(frozen=True)
class Model:
    """The sizes of one model that set kernel shapes (``heads`` 0: its attention is not sized here)."""

    hidden: int
    intermediate: int
    vocab: int
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 128
    experts: int = 0
    top_k: int = 0


MODELS: dict[str, Model] = {
    "llama3-8b": Model(4096, 14336, 128256, 32, 8),
    "llama3-70b": Model(8192, 28672, 128256, 64, 8),
    "qwen2.5-7b": Model(3584, 18944, 152064, 28, 4),
    "qwen3-32b": Model(5120, 25600, 151936, 64, 8),
    "mistral-7b": Model(4096, 14336, 32768, 32, 8),
    "gemma2-2b": Model(2304, 9216, 256000, 8, 4, head_dim=256),
    "gemma2-9b": Model(3584, 14336, 256000, 16, 8, head_dim=256),
    # multi-head latent attention is not the contract's attention: no heads here
    "deepseek-v3": Model(7168, 2048, 129280, experts=256, top_k=8),
}
"""Sizes from the models' published configurations; DeepSeek-V3's ``intermediate`` is one routed
expert's width."""

TOKENS = (1, 4096, 65536)
"""Token counts (batch × sequence) of the models sweep: decode, small batch, prefill, long."""

EVERY_WIDTH_TOKENS = (4096,)
"""The token counts at which every model width is timed (the others only at the Llama 3 widths)."""

MAX_ELEMENTS = 1 << 30
"""The largest activation timed (elements): eager's float32 math on it must fit beside the rest."""


@dataclass(frozen=True)
class Point:
    """One shape of a sweep: ``kernel`` at ``case`` (its name says the shape) in ``modes``."""

    kernel: str
    case: Case
    modes: tuple[str, ...]
    peers: tuple[str, ...] = ("eager", "compile", "library")
    """What it is timed against: torch eager and torch.compile of the contract's math, the libraries."""
    sweep: str = ""
    make: Callable[..., Args] | None = None
    """The inputs' builder and its keyword arguments (``case.make(g, dtype)`` calls it with them)."""
    kw: dict[str, Any] = field(default_factory=dict)

    @property
    def dtype(self) -> torch.dtype | None:
        """The dtype this point is timed in (None: the benchmark's ``--dtype``)."""
        return self.case.dtypes[0] if self.case.dtypes else None


def point(kernel: str, label: str, make: Callable[..., Args], modes: tuple[str, ...] = MODES,
          dtype: torch.dtype | None = None, **kw: Any) -> Point:
    """``kernel`` timed at the inputs ``make(g, dtype, **kw)``, in ``modes`` (forward only where
    the kernel has no gradient)."""
    if not SPECS[kernel].differentiable:
        modes = FWD
    case = Case(label, lambda g, dt: make(g, dt, **kw), dtypes=(dtype,) if dtype else None, perf=True)
    return Point(kernel, case, modes, make=make, kw=kw)


def _widths(field: str) -> list[tuple[str, int]]:
    """(first model of that size, size) for each distinct size of ``field`` among `MODELS`."""
    seen: dict[int, str] = {}
    for name, m in MODELS.items():
        seen.setdefault(getattr(m, field), name)
    return [(name, size) for size, name in seen.items()]


def _grid(field: str, per_token: int = 1) -> Iterable[tuple[str, int, int]]:
    """(label, tokens, width) over `MODELS`' distinct ``field`` sizes: every width at
    `EVERY_WIDTH_TOKENS`, the first two (Llama 3's) at every count of `TOKENS`. A count whose
    ``tokens · per_token · width`` passes `MAX_ELEMENTS` becomes the largest power of two within."""
    for i, (model, width) in enumerate(_widths(field)):
        fits = 1 << (MAX_ELEMENTS // (per_token * width)).bit_length() - 1
        for tokens in dict.fromkeys(min(t, fits) for t in (TOKENS if i < 2 else EVERY_WIDTH_TOKENS)):
            yield f"{model} T={tokens} {field}={width}", tokens, width


PEER_LED: dict[str, tuple[tuple[int, int], ...]] = {
    "rms_norm": ((32768, 5120), (8192, 8192), (8, 4096)),
    "softmax": ((8192, 8192), (16384, 8192)),
}
"""(tokens, width) beyond the models' own at which a peer once led on an H200 (FlagGems, Liger or
torch.compile): timed so that they stay measured."""


def _moe_models() -> list[tuple[str, int, int, int]]:
    """(name, hidden, experts, top-k): DeepSeek-V3, Qwen3-MoE's 128/top-8 and Mixtral's 8/top-2."""
    return [("deepseek-v3", 7168, 256, 8), ("qwen3-moe", 4096, 128, 8), ("mixtral", 4096, 8, 2)]


def models_sweep() -> list[Point]:
    """Every kernel whose shape a model's sizes set (attention and the products: their own sweeps)."""
    out: list[Point] = []
    for label, t, h in _grid("hidden"):
        out += [
            point("rms_norm", label, _make_rms_norm, shape=(t, h)),
            point("add_rms_norm", label, _make_rms_norm, shape=(t, h), residual=True),
            point("layer_norm", label, _make_layer_norm, shape=(t, h)),
            point("quantize_fp8", label, _make_quantize, shape=(t, h)),
            point("dequantize_fp8", label, _make_dequantize, shape=(t, h)),
        ]
    for label, t, width in _grid("intermediate"):
        out += [
            point("silu", label, _make_x(), shape=(t, width)),
            point("gelu", label, _make_x(approximate="none"), shape=(t, width)),
            point("swiglu", label, _make_gated(), shape=(t, width)),
            point("geglu", label, _make_gated(approximate="tanh"), shape=(t, width)),
        ]
    for t, h in PEER_LED["rms_norm"]:
        out.append(point("rms_norm", f"peer-led T={t} hidden={h}", _make_rms_norm, shape=(t, h)))
    for label, t, v in _grid("vocab"):
        out.append(point("softmax", label, _make_softmax, shape=(t, v)))
    for t, v in PEER_LED["softmax"]:
        out.append(point("softmax", f"peer-led T={t} width={v}", _make_softmax, shape=(t, v)))
    # the loss: eager holds several float32 copies of the logits
    for label, t, v in _grid("vocab", per_token=2):
        out.append(point("cross_entropy", label, _make_ce, shape=(t, v)))
    # eager computes the logits with a float32 product: at most 2^27 of them (seconds a call)
    for label, t, v in _grid("vocab", per_token=8):
        hidden = next(m.hidden for m in MODELS.values() if m.vocab == v)
        out.append(point("linear_cross_entropy", f"{label} hidden={hidden}", _make_lce, n=t, k=hidden, v=v))
    for name, m in MODELS.items():
        if not m.heads:
            continue
        for t in TOKENS if name == "llama3-8b" else EVERY_WIDTH_TOKENS:
            label = f"{name} T={t} heads={m.heads}/{m.kv_heads} D={m.head_dim}"
            out.append(point("rope", label, _make_rope, b=1, hq=m.heads, hk=m.kv_heads, s=t, d=m.head_dim))
    for name, hidden, experts, k in _moe_models():
        for t in TOKENS:
            label = f"{name} T={t} experts={experts} top-{k}"
            out.append(point("moe_gating", label, _make_gating, tokens=t, experts=experts, k=k))
            if t * k * hidden <= MAX_ELEMENTS:
                out.append(point("moe_dispatch", f"{label} hidden={hidden}", _make_dispatch, tokens=t,
                                 hidden=hidden, experts=experts, k=k))
                out.append(point("moe_combine", f"{label} hidden={hidden}", _make_combine, tokens=t, k=k,
                                 hidden=hidden, experts=experts))
    return out


def attention_sweep() -> list[Point]:
    """SDPA's ground: training and prefill shapes, grouped-query, head dims, decode."""
    out: list[Point] = []

    def add(label: str, modes: tuple[str, ...] = MODES, dtype: torch.dtype = torch.bfloat16, **kw: Any) -> None:
        kw = {"b": 4, "hq": 32, "hkv": 32, "sq": 4096, "skv": 4096, "d": 128, "causal": False, **kw}
        shape = (f"B{kw['b']} H{kw['hq']}/{kw['hkv']} Sq{kw['sq']} Skv{kw['skv']} D{kw['d']}"
                 f"{' causal' if kw['causal'] else ''} {str(dtype).removeprefix('torch.')}")
        out.append(point("attention", f"{label}: {shape}", _make_attention, modes, dtype, **kw))

    for dtype in (torch.bfloat16, torch.float16):
        for causal in (False, True):
            add("perf", dtype=dtype, causal=causal)
    for causal in (False, True):
        add("short", b=16, sq=1024, skv=1024, causal=causal)
        add("long", b=1, sq=16384, skv=16384, causal=causal)
    for ratio in (4, 8):
        add(f"gqa{ratio}", b=2, hkv=32 // ratio, sq=8192, skv=8192, causal=True)
    add("d64", b=4, sq=4096, skv=4096, d=64, causal=True)
    add("d64 short", b=16, hq=16, hkv=16, sq=1024, skv=1024, d=64)
    add("d64 fp16", b=4, sq=4096, skv=4096, d=64, causal=True, dtype=torch.float16)
    add("d256", FWD, b=4, hq=16, hkv=8, sq=4096, skv=4096, d=256, causal=True)
    add("d256 fp16", FWD, b=4, hq=16, hkv=8, sq=4096, skv=4096, d=256, causal=True, dtype=torch.float16)
    # decoding with a KV cache: the queries are the last positions of the keys (bottom-right causal)
    for sq in (1, 8):
        for skv in (1024, 8192, 32768):
            add("decode", FWD, b=8 if skv < 32768 else 1, hkv=8, sq=sq, skv=skv, causal=True)
    add("decode one sequence", FWD, b=1, hkv=8, sq=1, skv=4096, causal=True)
    add("decode gqa8", FWD, b=8, hkv=4, sq=16, skv=8192, causal=True)  # speculative, 128 query rows a KV head
    # chunked prefill: a chunk of queries against the cache before it and itself (bottom-right causal)
    add("prefill chunk", FWD, b=1, hkv=8, sq=512, skv=8192, causal=True)
    add("prefill chunk", FWD, b=1, hkv=8, sq=4096, skv=16384, causal=True)
    return out


LINEAR_TOKENS = (1, 16, 128, 1024, 4096, 8192, 16384)
"""Token counts of the linear sweep (its product is 8192×14336×4096 at 8192)."""

ACTIVATIONS = (None, "silu", "gelu", "gelu_tanh", "relu")


def linear_sweep() -> list[Point]:
    """``linear`` with each activation, ``fp8_linear`` with row-wise scales, ``grouped_linear`` on
    MoE shapes."""
    out: list[Point] = []
    for act in ACTIVATIONS:
        for t in LINEAR_TOKENS:
            label = f"llama3-8b up {t}×14336×4096 {act or 'no activation'}"
            out.append(point("linear", label, _make_linear, x=(t, 4096), n=14336, activation=act))
    out.append(point("linear", "peer-led 8192×8192×8192 no activation", _make_linear, x=(8192, 8192), n=8192,
                     activation=None))
    for t in (4096, 8192):
        out.append(point("linear", f"llama3-70b up {t}×28672×8192 silu", _make_linear, x=(t, 8192), n=28672,
                         activation="silu"))
    for t in LINEAR_TOKENS:
        for n, k, name in ((14336, 4096, "llama3-8b up"), (4096, 14336, "llama3-8b down")):
            out.append(point("fp8_linear", f"{name} {t}×{n}×{k} row scales", _make_fp8_linear, m=(t,), n=n, k=k,
                             bias=None))
    # rows = tokens · top-k, routed with a skew (uneven counts: some experts get many more rows)
    for name, experts, k, hidden, width, tokens in (
        ("mixtral", 8, 2, 4096, 14336, (512, 4096)),
        ("qwen3-moe", 128, 8, 4096, 1536, (512, 4096)),
        ("deepseek-v3", 256, 8, 7168, 2048, (512, 4096)),
    ):
        for t in tokens:
            label = f"{name} {experts} experts top-{k} T={t} {hidden}→{width} uneven"
            out.append(point("grouped_linear", label, _make_grouped, rows=t * k, k_dim=hidden, n_dim=width,
                             experts=experts, skewed=True))
    return out


def perf_sweep() -> list[Point]:
    """Each kernel's perf shape (its ``perf`` cases; docs/performance.md)."""
    return [Point(name, case, MODES if spec.differentiable else FWD)
            for name, spec in SPECS.items() for case in spec.cases() if case.perf]


SWEEPS: dict[str, Callable[[], list[Point]]] = {
    "perf": perf_sweep,
    "models": models_sweep,
    "attention": attention_sweep,
    "linear": linear_sweep,
}

LIBRARY_ONLY = ("attention", "linear")
"""Sweeps timed against the libraries alone (SDPA's backends; cuBLAS then the activation, eager and
compiled; ``_scaled_mm``; a cuBLAS loop and ``_grouped_mm``): the contract's float32 math is no
peer there, only the correctness oracle."""


def sweep(names: Iterable[str], kernels: Iterable[str] | None = None) -> list[Point]:
    """The points of the named sweeps ("all": every one), restricted to ``kernels`` if given."""
    names = list(names)
    if "all" in names:
        names = [n for n in SWEEPS if n != "perf"]
    points = [replace(p, sweep=n, peers=("library",) if n in LIBRARY_ONLY else p.peers)
              for n in names for p in SWEEPS[n]()]
    if kernels is not None:
        keep = set(kernels)
        points = [p for p in points if p.kernel in keep]
    return points


def measurements(points: Iterable[Point]) -> int:
    """How many (shape, mode) timings ``points`` hold."""
    return sum(len(p.modes) for p in points)


def _progress(items: list[Point], quiet: bool) -> Iterator[tuple[Point, Callable[[str], None]]]:
    """Each item with a print function: under a rich progress bar when rich is installed."""
    try:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    except ImportError:
        for item in items:
            yield item, (lambda line: None) if quiet else (lambda line: print(line, flush=True))
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, transient=True) as bar:
        task = bar.add_task("kpt bench", total=len(items))
        for item in items:
            bar.update(task, description=f"{item.kernel} {item.case.name}"[:60])
            yield item, (lambda line: None) if quiet else (lambda line: print(line, flush=True))
            bar.advance(task)


def _by_kernel(points: list[Point]) -> list[Point]:
    """``points`` grouped by kernel (in order of first appearance), so compiled code is reset once
    per kernel."""
    order = {k: i for i, k in reversed(list(enumerate(p.kernel for p in points)))}
    return sorted(points, key=lambda p: order[p.kernel])


def _args_bytes(args: dict[str, Any]) -> int:
    """The bytes of the tensors among ``args``."""
    return nbytes_of(*(v for v in args.values() if isinstance(v, torch.Tensor)))


def run_sweep(backend: Backend, points: list[Point], dtype: torch.dtype, ceilings: Ceilings, *,
              no_compile: bool = False, warmup: float = 5, rep: float = 25, host: bool = True,
              quiet: bool = False, time_limit: float | None = None,
              graphs: bool = False) -> tuple[list[Measurement], list[HostCost]]:
    """Measure every point of a sweep in every mode (``graphs``: replayed from CUDA graphs, see
    `time_ms`); then the host cost of each kernel's smallest point. A failure (wrong result, error,
    out of memory) is recorded at its point, and the sweep goes on. Points not started within
    ``time_limit`` seconds are recorded as skipped."""
    device = backend.device()
    results: list[Measurement] = []
    smallest: dict[str, tuple[int, str, dict[str, Any]]] = {}
    last_kernel = None
    deadline = time.perf_counter() + time_limit if time_limit else None
    for p, say in _progress(_by_kernel(points), quiet):
        spec = SPECS[p.kernel]
        dt = p.dtype or dtype
        if deadline is not None and time.perf_counter() > deadline:
            for mode in p.modes:
                results.append(Measurement(p.kernel, p.case.name, str(dt).removeprefix("torch."), mode, sweep=p.sweep,
                                           skipped=f"the time limit of {time_limit:.0f} s was reached"))
            continue
        if p.kernel != last_kernel:
            torch._dynamo.reset()
            forget_compiled(f"eager {last_kernel}")
            last_kernel = p.kernel
        peers = tuple(x for x in p.peers if not (no_compile and x == "compile"))
        try:
            args = draw_inputs(spec, p.case, dt, device, seed=len(results))
        except Exception as exc:
            args = None
            failure = error_line(exc)
        for mode in p.modes:
            if args is None:
                r = Measurement(p.kernel, p.case.name, str(dt).removeprefix("torch."), mode, wrong=failure)
            else:
                started = time.perf_counter()
                try:
                    r = measure_args(backend, spec, args, p.case.name, dt, mode, ceilings, peers, warmup, rep,
                                     compile_once=True, graphs=graphs)
                except Exception as exc:  # one shape's failure must not hide the others' numbers
                    r = Measurement(p.kernel, p.case.name, str(dt).removeprefix("torch."), mode,
                                    wrong=error_line(exc))
                r.seconds = time.perf_counter() - started
            r.sweep = p.sweep
            results.append(r)
            say(f"{row(r)} {r.seconds:.1f} s")
        if args is not None and host:
            size = _args_bytes(args)
            if p.kernel not in smallest or size < smallest[p.kernel][0]:
                smallest[p.kernel] = (size, p.case.name, args)
        del args
        if device.type == "cuda":
            torch.cuda.empty_cache()
    costs = []
    for kernel, (_, label, args) in smallest.items():
        try:
            costs.append(host_cost(backend, SPECS[kernel], args, label))
        except Exception as exc:
            costs.append(HostCost(kernel, label, errors={"backend": error_line(exc)}))
    return results, costs
