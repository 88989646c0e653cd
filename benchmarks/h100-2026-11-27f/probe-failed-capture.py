"""A failed CUDA-graph capture: does the allocator keep its memory, and does releasing the pool fix it?"""
import gc, sys, torch
variant = sys.argv[1]
dev = torch.cuda.current_device()
def mem(tag):
    gc.collect(); torch.cuda.empty_cache()
    print(f"  [{variant}] {tag}: allocated {torch.cuda.memory_allocated()/2**30:.2f} GiB reserved {torch.cuda.memory_reserved()/2**30:.2f} GiB", flush=True)
def body():
    a = torch.empty(2**30, dtype=torch.uint8, device="cuda")  # 1 GiB in the capture's pool
    b = a.float()  # 4 GiB more
    if variant != "ok":
        b.sum().item()  # not capturable: invalidates the capture
    return b
mem("start")
stream = torch.cuda.Stream()
g = torch.cuda.CUDAGraph()
pool = torch.cuda.graph_pool_handle()
try:
    with torch.cuda.graph(g, pool=pool, stream=stream):
        body()
    print("  captured")
except Exception as exc:
    print("  capture failed:", type(exc).__name__, str(exc).splitlines()[0][:150])
    if variant in ("end", "end+release"):
        try:
            torch._C._cuda_endAllocateToPool(dev, pool); print("  endAllocateToPool: ok")
        except Exception as e:
            print("  endAllocateToPool:", str(e).splitlines()[0][:150])
    if variant in ("release", "end+release"):
        try:
            torch._C._cuda_releasePool(dev, pool); print("  releasePool: ok")
        except Exception as e:
            print("  releasePool:", str(e).splitlines()[0][:150])
mem("after capture")
del g
mem("after del graph")
# later work with cross-stream uses (as autograd's backward makes): is its memory returned?
side = torch.cuda.Stream()
for i in range(6):
    x = torch.empty(4 * 2**30, dtype=torch.uint8, device="cuda")
    with torch.cuda.stream(side):
        x.add_(1)
    x.record_stream(side)
    del x
torch.cuda.synchronize()
mem("after 6 × 4 GiB with record_stream")
# a later capture still works?
g2 = torch.cuda.CUDAGraph()
x = torch.ones(1024, device="cuda")
with torch.cuda.graph(g2):
    y = x * 2
g2.replay(); torch.cuda.synchronize()
print("  later capture ok:", float(y[0]))
del g2, y
mem("end")
