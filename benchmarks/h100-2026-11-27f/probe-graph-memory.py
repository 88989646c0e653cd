"""Where graph-mode timing loses memory: memory after each timing, with and without gc.collect."""
import gc, os, sys, torch
import kpt.benchmark as kb
GC = os.environ.get("PROBE_GC") == "1"
orig_time, orig_measure = kb.time_ms, kb.measure_args
def time_ms(fn, device, *a, **k):
    try:
        return orig_time(fn, device, *a, **k)
    finally:
        print(f"   after timing: allocated {torch.cuda.memory_allocated()/1e9:6.2f} GB reserved {torch.cuda.memory_reserved()/1e9:6.2f} GB", flush=True)
def measure_args(backend, spec, args, label, *a, **k):
    r = orig_measure(backend, spec, args, label, *a, **k)
    if GC:
        gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    print(f"== {spec.name} {label} {a[1]}: errors {r.errors} wrong {r.wrong}; allocated {torch.cuda.memory_allocated()/1e9:.2f} GB, reserved {torch.cuda.memory_reserved()/1e9:.2f}, device free {free/1e9:.1f} GB, gc objects {len(gc.get_objects())}", flush=True)
    return r
kb.time_ms, kb.measure_args = time_ms, measure_args
sys.exit(kb.main(sys.argv[1:]))
