"""Train a ~125M-parameter Llama (random init, synthetic tokens) with plain transformers, with
Liger-Kernel's patch, or with kpt.patch, and compare loss, tokens/s and peak memory.

    python scripts/train_llama.py --mode hf    --steps 300 --out results/hf.json
    python scripts/train_llama.py --mode liger --steps 300 --out results/liger.json
    python scripts/train_llama.py --mode kpt   --steps 300 --out results/kpt.json
    python scripts/train_llama.py --mode kpt   --kpt-attention sdpa --steps 300 --out results/kpt-sdpa.json
    python scripts/train_llama.py --plot results/hf.json results/liger.json results/kpt.json --out loss.png
    python scripts/train_llama.py --fpga --out results/fpga.json    # forward on fpga-sim, U280 estimate
    python scripts/train_llama.py --tiny --mode kpt --steps 3       # the whole path on a CPU in seconds

The model: hidden 768, 12 layers, 12 query / 4 key-value heads, vocab 32000, sequence 2048,
batch 8, bf16 weights and activations, AdamW. The corpus is the same for every mode: token ids
drawn from a seeded Zipf-like distribution with a repeated-phrase structure, so that the loss
falls. tokens/s counts the steps after ``--warmup``; peak memory is
``torch.cuda.max_memory_allocated`` over the whole run.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch
import transformers

import kpt

FULL = {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12, "num_attention_heads": 12,
        "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 2048}
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 128}


def corpus(vocab: int, seq: int, rows: int, seed: int) -> torch.Tensor:
    """``rows`` sequences of ``seq`` token ids: Zipf-distributed words, each row built from phrases
    of a seeded phrase book, so there is structure to learn."""
    g = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, vocab + 1, dtype=torch.float64)
    phrases = torch.multinomial(1.0 / ranks, 256 * 16, replacement=True, generator=g).view(256, 16)
    picks = torch.randint(0, 256, (rows, seq // 16 + 1), generator=g)
    return phrases[picks].view(rows, -1)[:, :seq].contiguous()


def build(mode: str, shape: dict[str, int], device: torch.device, dtype: torch.dtype,
          kpt_attention: bool = True) -> Any:
    config = transformers.LlamaConfig(**shape, attn_implementation="sdpa", tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).to(device=device, dtype=dtype)
    if mode == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(model=model)
    elif mode == "kpt":
        print(kpt.patch(model, attention=kpt_attention))
    return model


def versions(device: torch.device) -> dict[str, str]:
    out = {"python": platform.python_version(), "torch": torch.__version__,
           "transformers": transformers.__version__, "kpt": kpt.__version__}
    for name in ("triton", "liger_kernel"):
        try:
            out[name] = __import__(name).__version__
        except (ImportError, AttributeError):
            pass
    out["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    out["kpt_backend"] = kpt.backend_for(device).name
    return out


def train(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = TINY if args.tiny else FULL
    seq, batch = (64, 2) if args.tiny else (args.seq, args.batch)
    dtype = torch.bfloat16 if device.type == "cuda" or not args.tiny else torch.float32
    model = build(args.mode, shape, device, dtype, args.kpt_attention == "kernel")
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1,
                            fused=device.type == "cuda")
    data = corpus(shape["vocab_size"], seq, batch * args.steps, args.seed)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    losses, times = [], []
    for step in range(args.steps):
        tokens = data[step * batch:(step + 1) * batch].to(device)
        start = time.perf_counter()
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())  # synchronizes: the step's time is complete
        times.append(time.perf_counter() - start)
        print(f"step {step:4d}  loss {losses[-1]:.4f}  {batch * seq / times[-1]:,.0f} tokens/s", flush=True)
    timed = times[args.warmup:] or times
    return {
        "mode": args.mode if args.mode != "kpt" or args.kpt_attention == "kernel" else "kpt (sdpa attention)",
        "tiny": args.tiny, "steps": args.steps, "warmup": args.warmup, "batch": batch,
        "seq": seq, "dtype": str(dtype).removeprefix("torch."), "model": shape,
        "parameters": sum(p.numel() for p in model.parameters()),
        "loss": losses, "tokens_per_s": batch * seq * len(timed) / sum(timed),
        "peak_memory_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        "versions": versions(device),
    }


def fpga(args: argparse.Namespace) -> dict[str, Any]:
    """The same model's forward on the fpga-sim backend (Alveo U280) for a short sequence: kpt's
    kernels run in the simulator and report their cost; the projections (torch's nn.Linear,
    which kpt.patch leaves) are estimated as kpt ``linear`` calls of their shapes. The embedding
    gather is not counted. Kernels run one after another: the latency is their sum."""
    import kpt_fpga_sim

    shape = TINY if args.tiny else FULL
    sim = kpt_fpga_sim.configure(kpt.get_backend("fpga-sim"), device="u280")
    model = build("kpt", shape, torch.device("cpu"), torch.float32).eval()
    linears = []

    def estimate(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], _: torch.Tensor) -> None:
        x = inputs[0].reshape(-1, inputs[0].shape[-1])
        linears.append(sim.estimate("linear", x.to("meta"), module.weight.to("meta")))

    hooks = [m.register_forward_hook(estimate) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    tokens = corpus(shape["vocab_size"], args.fpga_seq, 1, args.seed)
    with torch.no_grad(), kpt.use_backend(sim):
        logits = model(tokens).logits
    for h in hooks:
        h.remove()
    reports = [*sim.reports, *linears]
    by_kernel: dict[str, float] = {}
    for r in reports:
        by_kernel[r.kernel] = by_kernel.get(r.kernel, 0.0) + r.latency_us
    return {"mode": "fpga", "device": "u280", "seq": args.fpga_seq, "model": shape,
            "calls": len(reports), "latency_ms": sum(by_kernel.values()) / 1e3,
            "latency_us_by_kernel": by_kernel, "fits": all(r.fits for r in reports),
            "finite": bool(logits.isfinite().all()),
            "versions": {**versions(torch.device("cpu")), "kpt_backend": sim.name}}


def plot(paths: list[str], out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for path in paths:
        run = json.loads(Path(path).read_text())
        peak = f", {run['peak_memory_gib']:.1f} GiB" if run.get("peak_memory_gib") else ""
        ax.plot(run["loss"], label=f"{run['mode']}: {run['tokens_per_s']:,.0f} tokens/s{peak}", linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("Llama (random init, synthetic corpus): loss by implementation")
    ax.legend()
    fig.savefig(out, dpi=120, bbox_inches="tight")
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("hf", "liger", "kpt"), default="kpt")
    p.add_argument("--kpt-attention", choices=("kernel", "sdpa"), default="kernel",
                   help="--mode kpt: kpt's attention kernel, or transformers' sdpa around kpt's rope")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--warmup", type=int, default=10, help="steps left out of tokens/s")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--seed", type=int, default=1234, help="seed of the synthetic corpus")
    p.add_argument("--tiny", action="store_true",
                   help="a tiny model and batch (float32 on a CPU): the path, not the numbers")
    p.add_argument("--fpga", action="store_true", help="forward on the fpga-sim backend with a U280 latency estimate")
    p.add_argument("--fpga-seq", type=int, default=32, help="sequence length of the --fpga forward")
    p.add_argument("--plot", nargs="+", metavar="JSON", help="overlay the loss curves of these runs into --out (a PNG)")
    p.add_argument("--out", help="where to write the JSON (or, with --plot, the PNG)")
    args = p.parse_args(argv)
    if args.plot:
        plot(args.plot, args.out or "loss.png")
        return 0
    result = fpga(args) if args.fpga else train(args)
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(text if args.fpga else {k: v for k, v in result.items() if k != "loss"})
    return 0


if __name__ == "__main__":
    sys.exit(main())
