"""How ``kpt fpga-report estimate`` reads a network, without running code from the file.

- A ``torch.export`` program (``.pt2``, written by ``torch.export.save``): its graph of ATen
  operators is rebuilt as modules `kpt_fpga_sim.estimate_model` knows (`from_program`).
- A state dict (``torch.save(model.state_dict(), path)``, read with ``weights_only=True``) with
  ``--factory module:callable``, the code that builds the empty module: yours, imported like
  any installed module.
- A whole pickled module (``torch.save(model, path)``) only with ``--trust-pickle``: reading one
  is ``torch.load(weights_only=False)``, which runs whatever code the file names, before kpt can
  look at what it holds. Only for a file you made yourself.

    import torch
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)).eval()
    torch.export.save(torch.export.export(model, (torch.zeros(1, 16),)), "model.pt2")

(or ``kpt fpga-report example-model model.pt2``, `write_example`).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import pickle
import re
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from torch.export.pt2_archive import constants as pt2

from kpt.cli import UsageError
from kpt.errors import KernelNotSupportedError

_FACTORY = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The model options of ``estimate``: the file, ``--factory``, ``--trust-pickle``."""
    parser.add_argument("model", help="a torch.export program (.pt2), or a state dict with --factory")
    parser.add_argument("--factory", metavar="MODULE:CALLABLE",
                        help="the callable that builds the module whose state dict MODEL holds "
                             "(e.g. mypackage.models:make_mlp)")
    parser.add_argument("--trust-pickle", action="store_true",
                        help="read MODEL as a whole module pickled by torch.save(model): this runs any code "
                             "the file names (torch.load with weights_only=False), so only for files you made")


def load_model(args: argparse.Namespace) -> nn.Module:
    """The module that ``args`` (`add_arguments`'s options) name; `kpt.cli.UsageError` for a
    missing file, a file of another kind, or a factory that builds no module."""
    path = Path(args.model)
    if not path.is_file():
        raise UsageError(f"{path}: no such file (kpt fpga-report example-model {path} writes an example)")
    if args.trust_pickle:
        return _module(torch.load(path, weights_only=False), f"{path} (unpickled)")
    if args.factory:
        return _from_state_dict(path, args.factory)
    return from_program(load_program(path))


def load_program(path: Path) -> torch.export.ExportedProgram:
    """The torch.export program at ``path``, read only if it holds nothing to unpickle.

    ``torch.export.load`` unpickles some members of an archive (weights saved with
    ``use_pickle``, opaque and custom-class constants, legacy weight files, and example inputs
    that fail a weights-only read); an archive holding any of them, or any member outside the
    exported program's own (no AOTInductor libraries either), is refused, and every
    ``torch.load`` during the read is held to weights only."""
    if not zipfile.is_zipfile(path):
        raise UsageError(f"{path} is not a torch.export program (.pt2): give --factory for a state dict")
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
        if not any(n.endswith("/" + pt2.ARCHIVE_FORMAT_PATH) for n in names):
            raise UsageError(f"{path} is not a torch.export program (.pt2); for a state dict give --factory, "
                             "for a whole module pickled by torch.save(model) --trust-pickle")
        unsafe = [n for n in names if not _PROGRAM_MEMBER.fullmatch(n)]
        unsafe += [n for n in names if n.endswith("_config.json") and _pickled(json.loads(archive.read(n)), n)]
    if unsafe:
        raise UsageError(f"{path} holds members that reading it would unpickle or load as code "
                         f"({', '.join(unsafe[:3])}); kpt reads only plain exported programs")
    previous = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        return torch.export.load(path)
    except Exception as exc:  # torch's reader raises many kinds for a damaged or foreign archive
        raise UsageError(f"{path} cannot be read as a torch.export program: {type(exc).__name__}: "
                         f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''}") from None
    finally:
        if previous is None:
            del os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"]
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = previous


_PROGRAM_MEMBER = re.compile(
    rf"[^/]+/({re.escape(pt2.ARCHIVE_FORMAT_PATH)}|{re.escape(pt2.ARCHIVE_VERSION_PATH)}|byteorder|\.data/[\w.]+"
    rf"|{re.escape(pt2.MODELS_DIR)}[\w.-]+\.json|{re.escape(pt2.SAMPLE_INPUTS_DIR)}[\w.-]+\.pt"
    rf"|({re.escape(pt2.WEIGHTS_DIR)}|{re.escape(pt2.CONSTANTS_DIR)})([\w-]+|[\w.-]+_config\.json))")
"""The members of an exported program's archive: version records, the graph (JSON), example
inputs, raw tensor bytes and their configs (JSON)."""


def _pickled(config: Any, name: str) -> bool:
    """Whether a weights or constants config asks for anything but raw tensor bytes."""
    entries = config.get("config", {}) if isinstance(config, dict) else None
    if not isinstance(entries, dict):
        return True
    constants = f"/{pt2.CONSTANTS_DIR}" in name
    return any(not isinstance(e, dict) or e.get("use_pickle") is not False
               or (constants and not str(e.get("path_name", "")).startswith(pt2.TENSOR_CONSTANT_FILENAME_PREFIX))
               for e in entries.values())


def _module(value: Any, what: str) -> nn.Module:
    if not isinstance(value, nn.Module):
        raise UsageError(f"{what} is a {type(value).__name__}, not a torch.nn.Module")
    return value.eval()


def _from_state_dict(path: Path, factory: str) -> nn.Module:
    if not _FACTORY.fullmatch(factory):
        raise UsageError(f"--factory {factory}: expected module:callable, e.g. mypackage.models:make_mlp")
    module_name, _, attr = factory.partition(":")
    try:
        make: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            make = getattr(make, part)
    except (ImportError, AttributeError) as exc:
        raise UsageError(f"--factory {factory}: {exc}") from None
    try:
        built = make()
    except Exception as exc:  # the user's code: whatever it raises is a mistake in the option
        raise UsageError(f"--factory {factory}() raised {type(exc).__name__}: {exc}") from None
    model = _module(built, f"--factory {factory}'s result")
    try:
        state = torch.load(path, weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError):
        raise UsageError(f"{path} is not a state dict of tensors (a weights-only torch.load refused it); "
                         "for a whole module pickled by torch.save(model) give --trust-pickle") from None
    if not isinstance(state, dict):
        raise UsageError(f"{path} holds a {type(state).__name__}, not a state dict")
    try:
        model.load_state_dict(state)
    except RuntimeError as exc:
        raise UsageError(f"{path} does not fit --factory {factory}'s module: {' '.join(str(exc).split())}") from None
    return model


def _conv(dims: int) -> Callable[..., nn.Module]:
    def make(w: torch.Tensor, b: torch.Tensor | None = None, stride: Any = 1, padding: Any = 0, dilation: Any = 1,
             groups: int = 1) -> nn.Module:
        conv = (nn.Conv1d, nn.Conv2d)[dims - 1]
        kernel: Any = tuple(w.shape[2:])
        return conv(w.shape[1] * groups, w.shape[0], kernel, stride=stride, padding=padding,
                    dilation=dilation, groups=groups, bias=b is not None)
    return make


def _batch_norm(x: torch.fx.Node, w: torch.Tensor | None, b: torch.Tensor | None, mean: torch.Tensor,
                var: torch.Tensor, training: bool = False, momentum: float = 0.1, eps: float = 1e-5,
                *_: Any) -> nn.Module:
    norm = nn.BatchNorm2d if x.meta["val"].dim() == 4 else nn.BatchNorm1d
    return norm(mean.shape[0], eps=eps, affine=w is not None)


def _max_pool(kind: type[nn.Module]) -> Callable[..., nn.Module]:
    def make(kernel: Any, stride: Any = (), padding: Any = 0, dilation: Any = 1, ceil_mode: bool = False) -> nn.Module:
        return kind(kernel, stride or kernel, padding, dilation, ceil_mode=ceil_mode)
    return make


def _avg_pool(kind: type[nn.Module]) -> Callable[..., nn.Module]:
    def make(kernel: Any, stride: Any = (), *rest: Any) -> nn.Module:  # the rest in nn.AvgPool*d's order
        return kind(kernel, stride or kernel, *rest)
    return make


_aten = torch.ops.aten
_LAYERS: dict[Any, Callable[..., nn.Module]] = {
    _aten.linear.default: lambda w, b=None: nn.Linear(w.shape[1], w.shape[0], bias=b is not None),
    _aten.conv1d.default: _conv(1),
    _aten.conv2d.default: _conv(2),
    _aten.relu.default: nn.ReLU,
    _aten.sigmoid.default: nn.Sigmoid,
    _aten.tanh.default: nn.Tanh,
    _aten.softmax.int: lambda dim, dtype=None: nn.Softmax(dim),
    _aten.flatten.using_ints: lambda start=0, end=-1: nn.Flatten(start, end),
    _aten.max_pool1d.default: _max_pool(nn.MaxPool1d),
    _aten.max_pool2d.default: _max_pool(nn.MaxPool2d),
    _aten.avg_pool1d.default: _avg_pool(nn.AvgPool1d),
    _aten.avg_pool2d.default: _avg_pool(nn.AvgPool2d),
    _aten.adaptive_avg_pool1d.default: nn.AdaptiveAvgPool1d,
    _aten.adaptive_avg_pool2d.default: nn.AdaptiveAvgPool2d,
    _aten.constant_pad_nd.default: lambda pad, value=0.0: (nn.ConstantPad1d, nn.ConstantPad2d)[len(pad) // 2 - 1](
        tuple(pad), value),
}
"""ATen operator -> the module that computes it, from the call's arguments after the input
(tensors for weights); `_batch_norm` takes the input too, for its rank."""
_PARAMETERS: dict[Any, tuple[str, ...]] = {
    _aten.linear.default: ("weight", "bias"), _aten.conv1d.default: ("weight", "bias"),
    _aten.conv2d.default: ("weight", "bias"),
    _aten.batch_norm.default: ("weight", "bias", "running_mean", "running_var"),
}
_WIRING = {_aten.dropout.default, _aten.clone.default, _aten.alias.default, _aten.contiguous.default}
"""Operators that pass their input on in an inference graph."""


def from_program(program: torch.export.ExportedProgram) -> torch.fx.GraphModule:
    """``program``'s graph with each ATen layer call replaced by the `torch.nn` module that makes
    it (what `kpt_fpga_sim.estimate_model` models), its weights copied in; layers are named
    after the modules they came from. `kpt.KernelNotSupportedError` for an operator without one."""
    exported = program.module()
    root = nn.Module()
    graph = torch.fx.Graph()
    new: dict[torch.fx.Node, Any] = {}
    for node in exported.graph.nodes:
        if node.op == "get_attr":
            new[node] = functools.reduce(getattr, node.target.split("."), exported)
        elif node.op == "placeholder":
            new[node] = graph.placeholder(node.name)
        elif node.op == "call_module" and not node.users:  # the program's input guards
            continue
        elif node.op == "output":
            outputs = torch.fx.map_arg(node.args[0], new.__getitem__)
            graph.output(outputs[0] if len(outputs) == 1 else outputs)  # a program's outputs are a tuple
        elif node.op == "call_function" and node.target in _WIRING:
            new[node] = new[node.args[0]]
        elif node.op == "call_function" and (node.target in _LAYERS or node.target is _aten.batch_norm.default):
            new[node] = _layer(root, graph, node, [new.get(a, a) if isinstance(a, torch.fx.Node) else a
                                                   for a in node.args])
        else:
            raise KernelNotSupportedError(f"estimate: the program's {node.name} ({node.target}) is not a layer "
                                          "the estimate models (Linear, Conv1d/2d, BatchNorm, ReLU, Sigmoid, "
                                          "Tanh, Softmax, pooling, Flatten, zero padding)")
    return torch.fx.GraphModule(root, graph, class_name="ExportedModel")


def _layer(root: nn.Module, graph: torch.fx.Graph, node: torch.fx.Node, args: list[Any]) -> torch.fx.Node:
    values: list[Any] = [tuple(a) if isinstance(a, list) else a for a in args]  # shapes as nn modules take them
    x, rest = values[0], values[1:]
    if node.target is _aten.batch_norm.default:
        module = _batch_norm(cast(torch.fx.Node, node.args[0]), *rest)
    else:
        module = _LAYERS[node.target](*rest)
    with torch.no_grad():
        for name, value in zip(_PARAMETERS.get(node.target, ()), rest):
            if isinstance(value, torch.Tensor) and getattr(module, name, None) is not None:
                getattr(module, name).copy_(value)
    stack = node.meta.get("nn_module_stack") or {}
    path = next(reversed(stack.values()))[0] if stack else node.name
    name = re.sub(r"\W", "_", path.removeprefix("L['self'].")) or node.name
    while hasattr(root, name):
        name += "_"
    root.add_module(name, module.eval())
    return graph.call_module(name, (x,))


def example_model() -> nn.Module:
    """The network `write_example` saves: Linear 16->8, ReLU, Linear 8->4, Softmax (weights from seed 0)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4), nn.Softmax(dim=1)).eval()


def write_example(path: str | Path, *, force: bool = False) -> str:
    """Save `example_model` as a torch.export program at ``path``; returns what to run next."""
    path = Path(path)
    if path.exists() and not force:
        raise UsageError(f"{path} exists: give --force to replace it")
    torch.export.save(torch.export.export(example_model(), (torch.zeros(1, 16),)), path)
    return f"wrote {path}; estimate it with: kpt fpga-report estimate {path} --input-shape 1,16"
