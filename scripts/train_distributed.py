"""A small Llama trained a few dozen steps on one device, with FSDP2 and with tensor parallelism,
plain Hugging Face against the same model with kpt's kernels: losses, tokens/s, peak memory.

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 scripts/train_distributed.py --out results.json
    torchrun --nproc-per-node 2 scripts/train_distributed.py --tiny --device cpu   # gloo, seconds

Every run starts from the same random initialization (``--seed``) and trains on the same synthetic
tokens (the whole batch per step; FSDP gives each rank its share of the rows, TP gives every rank
all of them), so every plan's losses must match the single-device run's. Plans:

* ``single``: rank 0 alone on its device (the reference losses);
* ``fsdp``: every decoder layer and the root ``fully_shard``ed over all ranks;
* ``tp``: attention and MLP projections column-/row-wise parallel, the ``lm_head`` column-wise with
  logits left sharded over the vocabulary: the loss is vocabulary-parallel (``loss_parallel`` for
  Hugging Face, `kpt.distributed.cross_entropy` for kpt).

Implementations: ``hf`` (the model as Hugging Face writes it, SDPA attention) and ``kpt`` (its
RMSNorm, SwiGLU, rotary embedding and loss swapped for kpt kernels; with ``--patch``, by
``kpt.patch`` where kpt has it). Prints one JSON document (also to ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module

import kpt
import kpt.distributed

SMALL = {"hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8, "num_attention_heads": 16,
         "num_key_value_heads": 8, "vocab_size": 32000, "seq": 1024, "batch": 8}
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 256, "seq": 32, "batch": 4}


def build_model(opts: argparse.Namespace, shape: dict[str, int], device: torch.device) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{k: v for k, v in shape.items() if k not in ("seq", "batch")},
                         max_position_embeddings=shape["seq"], attn_implementation="sdpa",
                         tie_word_embeddings=False)
    torch.manual_seed(opts.seed)  # the same weights for every plan, on every rank
    return LlamaForCausalLM(config).to(device=device, dtype=getattr(torch, opts.dtype))


def swap_in_kpt(model: torch.nn.Module, be: kpt.Backend, use_patch: bool) -> tuple[str, Callable[[], None]]:
    """kpt kernels in place of the model's RMSNorm, SwiGLU and rotary embedding: how, and the
    undoing of what outlives the model (the module-level rotary function)."""
    if use_patch and hasattr(kpt, "patch"):
        summary = kpt.patch(model)
        return f"kpt.patch: {summary}", lambda: kpt.unpatch(model)
    from transformers.models.llama import modeling_llama

    hf_rope = modeling_llama.apply_rotary_pos_emb

    swapped = {"rms_norm": 0, "swiglu": 0}
    for module in model.modules():
        if isinstance(module, modeling_llama.LlamaRMSNorm):
            module.forward = (lambda m: lambda x: be.rms_norm(x, m.weight, m.variance_epsilon))(module)
            swapped["rms_norm"] += 1
        elif isinstance(module, modeling_llama.LlamaMLP):
            swapped["swiglu"] += 1
            if module.config.hidden_act != "silu":
                raise ValueError(f"the MLP's activation is {module.config.hidden_act}, not silu (SwiGLU)")
            module.forward = (lambda m: lambda x: m.down_proj(be.swiglu(m.gate_proj(x), m.up_proj(x))))(module)
    def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, unsqueeze_dim: int = 1) -> Any:
        if cos.shape[0] == 1:  # one table for the batch: [1, S, D] -> [S, D]
            cos, sin = cos[0], sin[0]
        return be.rope(q, k, cos, sin)

    # the attention calls the module's function by name at every call
    modeling_llama.apply_rotary_pos_emb = rope
    how = f"local swap: {swapped['rms_norm']} RMSNorm, {swapped['swiglu']} SwiGLU, rope, cross_entropy"
    return how, lambda: setattr(modeling_llama, "apply_rotary_pos_emb", hf_rope)


def tp_plan(model: torch.nn.Module) -> dict[str, Any]:
    plan: dict[str, Any] = {"lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for i in range(len(model.model.layers)):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            plan[f"model.layers.{i}.{name}"] = RowwiseParallel()
    return plan


def loss_backward(impl: str, plan: str, be: kpt.Backend) -> Callable[[Any, torch.Tensor], Any]:
    """Mean next-token loss of ``[B, S, V]`` logits (a vocabulary-sharded DTensor under TP), and
    its backward."""

    def step(logits: Any, labels: torch.Tensor) -> Any:
        flat, target = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
        if impl == "kpt":
            loss = kpt.distributed.cross_entropy(flat, target) if plan == "tp" else be.cross_entropy(flat, target)
            loss.backward()
        elif plan == "tp":
            with loss_parallel():  # its backward must run inside too
                loss = F.cross_entropy(flat, target)
                loss.backward()
        else:
            loss = F.cross_entropy(flat, target)
            loss.backward()
        return loss

    return step


def run(opts: argparse.Namespace, shape: dict[str, int], plan: str, impl: str, mesh: DeviceMesh | None,
        device: torch.device, be: kpt.Backend) -> dict[str, Any]:
    model = build_model(opts, shape, device)
    how, undo = swap_in_kpt(model, be, opts.patch) if impl == "kpt" else ("hf", lambda: None)
    rank, world = (dist.get_rank(), dist.get_world_size()) if plan != "single" else (0, 1)
    if plan == "fsdp":
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif plan == "tp":
        parallelize_module(model, mesh, tp_plan(model))
    optim = torch.optim.AdamW(model.parameters(), lr=opts.lr, foreach=False)
    # every step the same rows, each repeating its random phrase of 16 tokens: the loss falls fast
    phrase = torch.randint(0, shape["vocab_size"], (1, shape["batch"], 16),
                           generator=torch.Generator().manual_seed(opts.seed + 1))
    tokens = phrase.repeat(opts.steps, 1, shape["seq"] // 16 + 1)[..., : shape["seq"] + 1]
    share = shape["batch"] // world
    rows = slice(rank * share, (rank + 1) * share) if plan == "fsdp" else slice(None)
    loss_and_backward = loss_backward(impl, plan, be)
    losses, times = [], []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for step in range(opts.steps):
        batch = tokens[step, rows].to(device)
        _sync(device)
        start = time.perf_counter()
        logits = model(input_ids=batch[:, :-1]).logits
        loss = loss_and_backward(logits, batch[:, 1:])
        optim.step()
        optim.zero_grad(set_to_none=True)
        value = loss.full_tensor() if isinstance(loss, DTensor) else loss.detach()
        if plan == "fsdp":  # each rank's mean over its rows: the batch's mean is their mean
            dist.all_reduce(value, op=dist.ReduceOp.AVG)
        losses.append(float(value))
        _sync(device)
        times.append(time.perf_counter() - start)
    steady = times[min(opts.warmup, len(times) - 1):]
    result = {"plan": plan, "impl": impl, "swap": how, "losses": losses,
              "tokens_per_s": shape["batch"] * shape["seq"] / statistics.median(steady),
              "peak_memory_gib": None}
    if device.type == "cuda":
        peak = torch.tensor([torch.cuda.max_memory_allocated(device) / 2**30], device=device)
        if plan != "single":
            gathered = [torch.zeros_like(peak) for _ in range(world)]
            dist.all_gather(gathered, peak)
            result["peak_memory_gib"] = [round(float(p), 3) for p in gathered]
        else:
            result["peak_memory_gib"] = [round(float(peak), 3)]
    del model, optim
    undo()
    return result


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a tiny model (for a CPU check)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--backend", default=None, help="kpt backend (default: the best one for the device)")
    parser.add_argument("--plans", default="single,fsdp,tp")
    parser.add_argument("--impls", default="hf,kpt")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the timing")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--patch", action="store_true", help="swap the layers with kpt.patch where kpt has it")
    parser.add_argument("--tolerance", type=float, default=None,
                        help="largest difference from the single-device losses (default 1e-4 float32, 0.1 "
                             "bfloat16: its losses near 5 are 1/32 apart, and kernels rounding differently drift)")
    parser.add_argument("--out", default=None)
    opts = parser.parse_args()
    shape = TINY if opts.tiny else SMALL
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("nccl" if opts.device == "cuda" else "gloo")
    rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    if opts.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
    mesh = init_device_mesh(device.type, (world,)) if distributed else None
    be = kpt.get_backend(opts.backend or ("reference" if device.type == "cpu" else None))
    runs = []
    for plan in opts.plans.split(","):
        if plan != "single" and not distributed:
            continue
        for impl in opts.impls.split(","):
            if plan == "single":
                result = run(opts, shape, plan, impl, None, device, be) if rank == 0 else None
                if distributed:
                    dist.barrier()
            else:
                result = run(opts, shape, plan, impl, mesh, device, be)
            if rank == 0:
                runs.append(result)
    if rank == 0:
        report(opts, shape, runs, be, world, device)
    if distributed:
        dist.destroy_process_group()


def report(opts: argparse.Namespace, shape: dict[str, int], runs: list[dict[str, Any]], be: kpt.Backend,
           world: int, device: torch.device) -> None:
    import transformers

    tolerance = opts.tolerance or (1e-4 if opts.dtype == "float32" else 0.1)
    reference = next((r["losses"] for r in runs if r["plan"] == "single" and r["impl"] == "hf"), None)
    for r in runs:
        if reference is not None:
            r["max_loss_diff_vs_single_hf"] = max(abs(a - b) for a, b in zip(r["losses"], reference))
            r["matches_single"] = r["max_loss_diff_vs_single_hf"] <= tolerance
    hf = {r["plan"]: r for r in runs if r["impl"] == "hf"}
    for r in runs:
        if r["impl"] == "kpt" and r["plan"] in hf:
            r["speedup_vs_hf"] = r["tokens_per_s"] / hf[r["plan"]]["tokens_per_s"]
    doc = {
        "schema": 1, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "world_size": world, "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                                          "kpt": kpt.__version__},
        "kpt_backend": be.name, "dtype": opts.dtype, "model": shape, "steps": opts.steps, "tolerance": tolerance,
        "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"), "runs": runs,
    }
    text = json.dumps(doc, indent=1)
    print(text)
    if opts.out:
        with open(opts.out, "w") as f:
            f.write(text + "\n")
    bad = [f"{r['plan']}/{r['impl']}" for r in runs if r.get("matches_single") is False]
    if bad:
        raise SystemExit(f"losses differ from the single-device run beyond {tolerance}: {', '.join(bad)}")


if __name__ == "__main__":
    main()
