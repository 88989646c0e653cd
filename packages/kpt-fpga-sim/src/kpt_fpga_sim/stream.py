"""The io_stream timing model of `kpt_fpga_sim.network`: layers as loops over stream beats.

In ``io="stream"`` the layers of a network run at once (DATAFLOW), joined by FIFOs that carry
one pixel of all channels a beat. Each layer is a loop over its input beats: a `Flow` says which
input beat each iteration waits for, its initiation interval and which iterations write an output
beat. Running the flows of the layers one after the other over the input stream's arrival times
gives every beat's arrival at the next FIFO, so the network's latency is the fill of the chain
plus the image at the slowest layer's rate. The FIFOs, padding and line buffers a streamed layer
needs are costed here as well (`fifo`, `padded_sources`, `window_registers`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .devices import Device, memory_blocks

SRL_DEPTH = 32
"""A FIFO at most this deep is built of shift-register LUTs (SRLC32E), a deeper one in block RAM
(in the published hls4ml CNN report, FIFOs 36 deep take a BRAM, 16 deep none)."""


@dataclass(frozen=True)
class Flow:
    """A streamed layer as a loop: iteration ``i`` waits for input beat ``deps[i]`` (-1: none)
    and for iteration ``i - 1`` (``ii`` cycles earlier at the soonest); the iterations of
    ``emits`` write an output beat, ``depth`` cycles after they start."""

    deps: torch.Tensor
    ii: int
    emits: torch.Tensor
    depth: int = 1

    @classmethod
    def from_latency(cls, deps: torch.Tensor, ii: int, emits: torch.Tensor, latency: int) -> Flow:
        """The flow of a layer whose standalone latency (input beats waiting) is ``latency``."""
        return cls(deps, ii, emits, max(latency - (deps.numel() - 1) * ii, 1))

    @classmethod
    def beats(cls, beats_in: int, beats_out: int, latency: int) -> Flow:
        """A beat in, a beat out (equal counts), or every output after the last input beat."""
        emits = (
            torch.ones(beats_in, dtype=torch.bool)
            if beats_in == beats_out
            else torch.arange(beats_in) >= beats_in - beats_out
        )
        return cls.from_latency(torch.arange(beats_in), 1, emits, latency)

    def run(self, arrivals: torch.Tensor) -> tuple[torch.Tensor, int]:
        """``(output beat times, when the last iteration is done)`` for input beats arriving at
        ``arrivals`` (cycles from the start of the design)."""
        n = self.deps.numel()
        ready = torch.where(self.deps >= 0, arrivals[self.deps.clamp_min(0)], 0)
        steps = torch.arange(n, dtype=torch.int64) * self.ii
        # start[i] = max(ready[i], start[i-1] + ii) = i·ii + max over j <= i of (ready[j] - j·ii)
        start = steps + torch.cummax(ready - steps, 0).values
        return start[self.emits] + self.depth, int(start[-1]) + self.depth


def fifo(width: int, depth: int, device: Device) -> dict[str, int]:
    """A FIFO of ``width`` × ``depth`` bits: shift-register LUTs (32 deep each) up to
    `SRL_DEPTH`, block RAM beyond."""
    if width * depth == 0:
        return {}
    if depth <= SRL_DEPTH:
        return {"lut": width * math.ceil(depth / SRL_DEPTH)}
    return memory_blocks(width, depth, device, lutram=False)


def padded_sources(spatial: tuple[int, ...], pads: list[tuple[int, int]]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """For each pixel of the image zero-padded by ``pads`` (before, after per dimension) in raster
    order: the last input pixel it waits for (itself, or the input pixel before a padding one; -1
    before the first), and its coordinates."""
    padded = [d + a + b for d, (a, b) in zip(spatial, pads)]
    index = [t.reshape(-1) for t in torch.meshgrid(*(torch.arange(n) for n in padded), indexing="ij")]
    inside = torch.ones(math.prod(padded), dtype=torch.bool)
    for i, n, (a, _) in zip(index, spatial, pads):
        inside &= (i >= a) & (i < a + n)
    source = torch.where(inside, torch.cumsum(inside.to(torch.int64), 0) - 1, -1)
    return torch.cummax(source, 0).values, index


def window_registers(kernel: tuple[int, ...], width: int, channels: int, bits: int) -> int:
    """Register bits of a streamed window: the K-1 lines above it (2-D) and the window itself,
    all channels. Registers (not shift-register LUTs: hls4ml's line buffers shift only when a
    pixel arrives), each with a hold multiplexer: as many LUTs."""
    lines = (kernel[0] - 1) * width if len(kernel) == 2 else 0
    return (lines + math.prod(kernel)) * channels * bits
