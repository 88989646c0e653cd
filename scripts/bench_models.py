"""Whole models on a GPU, as model builders run them: training throughput, peak memory and loss of
transformers (eager and ``torch.compile``), Liger-Kernel and ``kpt.patch`` (eager and compiled) on
three architectures, padded and packed fine-tuning, and ``generate()`` with the dynamic and the
static cache.

    python scripts/bench_models.py train    --steps 100 --out results/   # 3 architectures x 5 modes
    python scripts/bench_models.py train    --inputs trainer ...          # as the Trainer runs them
    python scripts/bench_models.py sft      --steps 60  --out results/   # padded and packed batches
    python scripts/bench_models.py generate --out results/               # batch 1 and 16, three loops
    python scripts/bench_models.py table results/                        # the Markdown tables
    python scripts/bench_models.py plot results/ loss.png                # the training runs' loss curves

Each run is its own process (its compile caches and peak memory are its own); the runs of one
command go one after another, architectures outer, modes inner. Models are random-initialised,
in bfloat16, on synthetic token ids (scripts/train_llama.py's corpus); AdamW. tokens/s counts the
steps after the first ``--warmup`` (compilation included there); each step's time is kept, and the
table gives their spread (a run slowed by a recompile or a clock drop shows there), beside the time
the host took to queue each step (its kernels launched, before the loss is read): where that nears
the step's time, the GPU waits for the host. ``--rounds N``
runs every architecture and mode N times, round after round (the modes interleaved), and the table
gives the median run with the range.

``train`` gives the models ``input_ids`` and ``labels`` (``--inputs full``), or also an attention
mask of ones with ``use_cache=False`` (``--inputs trainer``: what the ``Trainer`` and its collators
give; under ``torch.compile`` transformers then builds a whole ``[B, 1, S, S]`` mask for ``sdpa``,
since a traced graph cannot tell that it masks nothing, and `kpt.patch` gives its attention the
``[B, S]`` key padding). Packed batches run with ``use_cache=False`` too: with a cache
transformers' ``sdpa`` masks do not separate the documents. Generation is greedy; its bandwidth
limit is the bytes of the weights plus the KV cache read per step over the copy bandwidth measured
in the same process. ``--caches graph`` decodes with `kpt.generate` (a static cache, each step
replayed from a CUDA graph) instead of ``generate()``, on the patched model (``kpt``) or the unpatched
one (``hf``); the table counts the rows whose tokens equal those of transformers' static path.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ARCHS: dict[str, tuple[str, dict[str, Any]]] = {
    # the 125M Llama of scripts/train_llama.py
    "llama-125m": ("LlamaConfig", {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12,
                                   "num_attention_heads": 12, "num_key_value_heads": 4, "vocab_size": 32000}),
    # Qwen3's vocabulary (and q/k norms) on the same body
    "qwen3-151k": ("Qwen3Config", {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12,
                                   "num_attention_heads": 12, "num_key_value_heads": 4, "head_dim": 64,
                                   "vocab_size": 151936}),
    # grouped-query attention, 6 query heads per key/value head
    "mistral-gqa": ("MistralConfig", {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12,
                                      "num_attention_heads": 12, "num_key_value_heads": 2, "head_dim": 64,
                                      "vocab_size": 32000, "sliding_window": None}),
    # for generate(): a 1.3B-shaped Llama
    "llama-1.3b": ("LlamaConfig", {"hidden_size": 2048, "intermediate_size": 5504, "num_hidden_layers": 24,
                                   "num_attention_heads": 16, "num_key_value_heads": 16, "vocab_size": 32000}),
}
MODES = ("hf", "hf+compile", "liger", "kpt", "kpt+compile")
LIGER = {"llama-125m": "apply_liger_kernel_to_llama", "qwen3-151k": "apply_liger_kernel_to_qwen3",
         "mistral-gqa": "apply_liger_kernel_to_mistral", "llama-1.3b": "apply_liger_kernel_to_llama"}


def build(arch: str, mode: str) -> Any:
    import transformers

    import kpt

    cls, shape = ARCHS[arch]
    config = getattr(transformers, cls)(**shape, max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model = model.to(device="cuda", dtype=torch.bfloat16)
    if mode.startswith("liger"):
        import liger_kernel.transformers as liger

        getattr(liger, LIGER[arch])(model=model)
    elif mode.startswith("kpt"):
        kpt.patch(model)
    return model


def versions() -> dict[str, str]:
    import transformers

    import kpt

    out = {"torch": torch.__version__, "transformers": transformers.__version__, "kpt": kpt.__version__,
           "device": torch.cuda.get_device_name(), "cuda": str(torch.version.cuda)}
    for name in ("triton", "liger-kernel"):
        try:
            out[name.replace("-", "_")] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def batches(kind: str, vocab: int, batch: int, seq: int, steps: int) -> list[dict[str, torch.Tensor]]:
    """``steps`` batches: ``full`` rows of ``seq`` tokens; ``padded`` rows of random lengths in
    [seq/4, seq], right-padded with their mask and -100 labels; ``packed`` documents of those lengths
    concatenated into rows of ``seq`` with restarting ``position_ids`` (DataCollatorWithFlattening's
    form)."""
    sys.path.insert(0, str(Path(__file__).parent))
    from train_llama import corpus

    data = corpus(vocab, seq, batch * steps, 1234)
    g = torch.Generator().manual_seed(5)
    out = []
    for step in range(steps):
        tokens = data[step * batch:(step + 1) * batch]
        if kind in ("full", "trainer"):
            out.append({"input_ids": tokens, "labels": tokens})
            if kind == "trainer":
                out[-1]["attention_mask"] = torch.ones_like(tokens)
            continue
        lengths = torch.randint(seq // 4, seq + 1, (batch,), generator=g)
        if kind == "padded":
            mask = (torch.arange(seq)[None, :] < lengths[:, None]).long()
            labels = tokens.masked_fill(mask == 0, -100)
            out.append({"input_ids": tokens * mask, "attention_mask": mask, "labels": labels})
        else:
            positions = torch.cat([torch.arange(int(n)) for n in lengths.repeat(4)])[: batch * seq].view(batch, seq)
            labels = tokens.masked_fill(positions == 0, -100)
            out.append({"input_ids": tokens, "position_ids": positions, "labels": labels})
    return out


def one_train(arch: str, mode: str, kind: str, steps: int, warmup: int, batch: int, seq: int) -> dict[str, Any]:
    model = build(arch, mode)
    model.train()
    step_fn = torch.compile(model) if mode.endswith("+compile") else model
    opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    data = batches(kind, model.config.vocab_size, batch, seq, steps)
    torch.cuda.reset_peak_memory_stats()
    losses, times, issued, real = [], [], [], []
    for b in data:
        b = {k: v.cuda(non_blocking=True) for k, v in b.items()}
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = step_fn(**b, **({"use_cache": False} if kind in ("trainer", "packed") else {})).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        issued.append(time.perf_counter() - start)  # the host has queued the step: where it nears the
        losses.append(loss.item())                   # step's time, the GPU waits for the host
        times.append(time.perf_counter() - start)
        real.append(int((b["labels"] != -100).sum()) if kind == "padded" else b["input_ids"].numel())
    timed = slice(warmup, None)
    return {"arch": arch, "mode": mode, "kind": kind, "steps": steps, "warmup": warmup, "batch": batch, "seq": seq,
            "loss_dtype": str(loss.dtype), "loss": losses,
            "tokens_per_s": sum(real[timed]) / sum(times[timed]), "step_seconds": [round(t, 6) for t in times],
            "host_seconds": [round(t, 6) for t in issued],
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30, "versions": versions()}


def copy_bandwidth() -> float:
    """Bytes read plus written per second by a 1 GiB device-to-device copy (median of 20)."""
    import triton.testing

    src = torch.empty(2**29, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median")
    return 2 * src.numel() * src.element_size() / (ms * 1e-3)


def one_generate(arch: str, mode: str, cache: str, batch: int, prompt: int, new: int) -> dict[str, Any]:
    import kpt

    model = build(arch, mode).eval()
    tokens = torch.randint(1, 32000, (batch, prompt), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    mask = torch.ones_like(tokens)
    mask[: batch // 2, : prompt // 4] = 0  # half the rows left-padded, as a tokenizer pads a batch
    kw = {"attention_mask": mask, "max_new_tokens": new, "min_new_tokens": new, "do_sample": False, "pad_token_id": 0}
    if cache == "static":
        kw["cache_implementation"] = "static"

    def run() -> torch.Tensor:
        if cache == "graph":  # kpt's decode loop, its step a CUDA graph
            return kpt.generate(model, tokens, mask, max_new_tokens=new, eos_token_id=[], pad_token_id=0)
        return model.generate(tokens, **kw)

    with torch.no_grad():
        if cache != "graph":
            model.generate(tokens, **{**kw, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up (and compile)
        run()  # warm-up (kpt.generate: compiles and captures the step, kept for the next call)
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = run()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    c = model.config
    kv_per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 2
    mean_kv = batch * kv_per_token * (prompt + new / 2)
    step_bytes = weights + mean_kv
    bw = copy_bandwidth()
    step = seconds / new
    return {"arch": arch, "mode": mode, "cache": cache, "batch": batch, "prompt": prompt, "new": new,
            "tokens_per_s": batch * new / seconds, "step_ms": step * 1e3,
            "bandwidth_limit_ms": step_bytes / bw * 1e3, "fraction_of_bandwidth_limit": step_bytes / bw / step,
            "copy_gb_s": bw / 1e9, "tokens": out[:, prompt:].tolist(), "versions": versions()}


def launch(out: Path, name: str, *args: str) -> None:
    path = out / f"{name.replace('+', '-')}.json"  # "+" is no file name for every tool
    cmd = [sys.executable, __file__, "one", str(path), *args]
    print("+", " ".join(cmd[2:]), flush=True)
    done = subprocess.run(cmd, timeout=900)
    if done.returncode:
        path.write_text(json.dumps({"name": name, "failed": done.returncode, "args": args}))


def spread(run: dict[str, Any], key: str = "step_seconds") -> str:
    """The 10th, 50th and 90th percentiles of a training run's timed steps in ms: their wall time, or
    with ``key="host_seconds"`` the time the host took to queue them (a run recorded before these
    were kept: empty)."""
    steps = sorted(run.get(key, [])[run["warmup"]:])
    if not steps:
        return ""
    return " / ".join(f"{steps[min(len(steps) - 1, int(q * len(steps)))] * 1e3:.1f}" for q in (0.1, 0.5, 0.9))


def median_run(group: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median tokens/s among runs of one architecture and mode (the lower middle one of
    an even count)."""
    return sorted(group, key=lambda r: r["tokens_per_s"])[(len(group) - 1) // 2]


def training_groups(runs: list[dict[str, Any]]) -> dict[tuple[str, str, str], list[dict[str, Any]]]:
    """The training runs among ``runs`` by architecture, inputs and mode."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for r in runs:
        if r.get("kind") in ("full", "trainer"):
            groups.setdefault((r["arch"], r["kind"], r["mode"]), []).append(r)
    return groups


def table(folder: Path) -> str:
    runs = [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]
    lines = []
    groups = training_groups(runs)
    if groups:
        lines += ["| architecture | inputs | mode | tokens/s | vs transformers + compile | step ms p10 / p50 / p90 "
                  "| host ms p10 / p50 / p90 | peak GiB | final loss | loss dtype |", "|---" * 10 + "|"]
        for (arch, kind, mode), group in groups.items():
            r = median_run(group)
            base = groups.get((arch, kind, "hf+compile"))
            ratio = f"{r['tokens_per_s'] / median_run(base)['tokens_per_s']:.3f}" if base else ""
            rate = f"{r['tokens_per_s']:,.0f}"
            if len(group) > 1:
                rate += f" ({min(g['tokens_per_s'] for g in group):,.0f}–{max(g['tokens_per_s'] for g in group):,.0f}, "
                rate += f"{len(group)} runs)"
            lines.append(f"| {arch} | {kind} | {mode} | {rate} | {ratio} | {spread(r)} | {spread(r, 'host_seconds')} | "
                         f"{r['peak_memory_gib']:.2f} | {r['loss'][-1]:.4f} | {r['loss_dtype']} |")
    sft = [r for r in runs if r.get("kind") in ("padded", "packed")]
    if sft:
        lines += ["", "| batches | mode | real tokens/s | peak GiB |", "|---|---|---|---|"]
        lines += [f"| {r['kind']} | {r['mode']} | {r['tokens_per_s']:,.0f} | {r['peak_memory_gib']:.2f} |" for r in sft]
    gen = [r for r in runs if "cache" in r]
    if gen:
        lines += ["", "| batch | mode | cache | tokens/s | ms a step | bandwidth limit ms | fraction of limit "
                  "| rows as transformers' static |", "|---|---|---|---|---|---|---|---|"]
        static = {r["batch"]: r["tokens"] for r in gen if (r["mode"], r["cache"]) == ("hf", "static")}
        for r in gen:
            rows = static.get(r["batch"])
            same = f"{sum(a == b for a, b in zip(r['tokens'], rows))} of {len(rows)}" if rows else ""
            lines.append(f"| {r['batch']} | {r['mode']} | {r['cache']} | {r['tokens_per_s']:,.1f} | "
                         f"{r['step_ms']:.2f} | {r['bandwidth_limit_ms']:.3f} | {r['fraction_of_bandwidth_limit']:.3f} "
                         f"| {same} |")
    failed = [r for r in runs if "failed" in r]
    lines += [f"- failed: {r['name']} (exit {r['failed']})" for r in failed]
    return "\n".join(lines)


def plot(folder: Path, png: Path) -> None:
    """The loss of every step of the training runs in ``folder`` (the median run of each mode where
    there are several), a panel per architecture and inputs, a line per mode, into ``png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = training_groups([json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))])
    if not groups:
        raise SystemExit(f"no training run in {folder}")
    panels: dict[tuple[str, str], dict[str, list[dict[str, Any]]]] = {}
    for (arch, kind, mode), group in groups.items():
        panels.setdefault((arch, kind), {})[mode] = group
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False, sharey=True)
    for ax, ((arch, kind), modes) in zip(axes[0], panels.items()):
        for mode, group in sorted(modes.items(), key=lambda m: MODES.index(m[0]) if m[0] in MODES else len(MODES)):
            r = median_run(group)
            ax.plot(range(1, len(r["loss"]) + 1), r["loss"], lw=0.8,
                    label=f"{mode}: {r['tokens_per_s']:,.0f} tokens/s, {r['peak_memory_gib']:.2f} GiB")
        ax.set(title=f"{arch} ({kind} inputs)", xlabel="step", yscale="log")
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("loss")
    first = next(iter(groups.values()))[0]
    v = first.get("versions", {})
    fig.suptitle(f"{v.get('device', '')}, torch {v.get('torch', '')}, transformers {v.get('transformers', '')}: "
                 f"batch {first['batch']} x {first['seq']}, bf16, AdamW", fontsize=9)
    fig.savefig(png, dpi=110, bbox_inches="tight")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("train", "sft", "generate", "table", "plot", "one"))
    p.add_argument("rest", nargs="*")
    p.add_argument("--out", default="results")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--archs", default="llama-125m,qwen3-151k,mistral-gqa")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--batches", default="1,16", help="generate: the batch sizes")
    p.add_argument("--caches", default="dynamic,static,graph",
                   help="generate: transformers' generate() with the dynamic or the static cache, or kpt.generate")
    p.add_argument("--rounds", type=int, default=1, help="train: runs of each architecture and mode, interleaved")
    p.add_argument("--inputs", choices=("full", "trainer"), default="full", help="train: what the models are given")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.what == "one":
        path, kind, *rest = args.rest
        result = one_generate(*rest[:3], *map(int, rest[3:])) if kind == "generate" else \
            one_train(*rest[:2], kind, *map(int, rest[2:]))
        Path(path).write_text(json.dumps(result, indent=1))
        print(json.dumps({k: v for k, v in result.items() if k not in ("loss", "tokens", "versions")}), flush=True)
    elif args.what == "train":
        for round_ in range(1, args.rounds + 1):
            for arch in args.archs.split(","):
                for mode in args.modes.split(","):
                    name = (f"train-{arch}-{mode}" + ("-trainer" if args.inputs == "trainer" else "")
                            + (f"-{round_}" if args.rounds > 1 else ""))
                    launch(out, name, args.inputs, arch, mode, str(args.steps), str(args.warmup), "8", "2048")
    elif args.what == "sft":
        for kind in ("padded", "packed"):
            for mode in args.modes.split(","):
                launch(out, f"sft-{kind}-{mode}", kind, "llama-125m", mode, str(args.steps), str(args.warmup), "8",
                       "2048")
    elif args.what == "generate":
        for batch in map(int, args.batches.split(",")):
            for mode in args.modes.split(","):
                for cache in args.caches.split(","):
                    launch(out, f"generate-b{batch}-{mode}-{cache}", "generate", "llama-1.3b", mode, cache,
                           str(batch), "128", "128")
    elif args.what == "plot":
        folder, png = args.rest
        plot(Path(folder), Path(png))
    else:
        print(table(Path(args.rest[0] if args.rest else args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
