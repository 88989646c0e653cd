"""(With activation-even-not-kept.patch applied.) kpt's activation forward with EVEN (no mask) against the masked
kernel (the committed code path), replayed from graphs, alternating, 5 timings each; and compile of the same."""
import torch, torch.nn.functional as F
from kpt.benchmark import graph_ms
from kpt_triton import activations as A
from kpt_triton.tiling import as_rows, row_tiling, spread, tiles, warps, dense_like
def fwd(act, x, up, even):
    y = dense_like(x)
    x2, up2 = A.as_rows(x, up if up is not None else x)
    r, d = x2.shape
    block, epw = spread(x.numel(), 8192, 512, x.device)
    br, bd = row_tiling(d, max_block=block, tile_elems=block)
    A._act_fwd_kernel[(tiles(r, d, br, bd),)](x2, up2, y, r, d, *x2.stride(), *up2.stride(), ACT=act,
        GATED=up is not None, BLOCK_R=br, BLOCK_D=bd, EVEN=even and r % br == 0 and d % bd == 0,
        num_warps=warps(br * bd, epw))
    return y
comp = {"gelu": torch.compile(F.gelu), "silu": torch.compile(F.silu)}
print("| act | gated | shape | masked µs | EVEN µs | compile µs | equal |")
for act in ("gelu", "silu"):
    for gated in (False, True):
        for shape in ((1, 4096), (1, 14336), (1, 28672), (4096, 14336)):
            x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16); up = torch.randn_like(x) if gated else None
            same = torch.equal(fwd(act, x, up, True), fwd(act, x, up, False))
            t = {True: [], False: []}
            for _ in range(5):
                for even in (False, True):
                    t[even].append(graph_ms(lambda: fwd(act, x, up, even), rep=10) * 1e3)
            c = comp[act]; c(x)
            tc = min(graph_ms(lambda: c(x), rep=10) * 1e3 for _ in range(3)) if not gated else float("nan")
            med = lambda v: sorted(v)[2]
            print(f"| {act} | {gated} | {shape} | {med(t[False]):.3f} ({min(t[False]):.3f}-{max(t[False]):.3f}) | "
                  f"{med(t[True]):.3f} ({min(t[True]):.3f}-{max(t[True]):.3f}) | {tc:.3f} | {same} |", flush=True)
