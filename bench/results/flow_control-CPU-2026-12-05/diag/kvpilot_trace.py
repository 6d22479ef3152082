"""Temporary diagnostics (not committed): per-request marks, GC pauses, event-loop lag."""
import asyncio, contextvars, gc, json, os, time
DIR = os.environ.get("KVPILOT_TRACE_DIR")
RID = contextvars.ContextVar("rid", default=None)
_f = None
def _write(row):
    global _f
    if _f is None:
        _f = open(f"{DIR}/{os.getpid()}.jsonl", "a", buffering=1)
    _f.write(json.dumps(row) + "\n")
def mark(what, rid=None, t=None):
    rid = rid or RID.get()
    if DIR and rid:
        _write([rid, what, time.monotonic() if t is None else t])
_gc_t = [0.0]
def _on_gc(phase, info):
    if phase == "start":
        _gc_t[0] = time.monotonic()
    else:
        d = time.monotonic() - _gc_t[0]
        if d > 0.002:
            _write(["gc", info["generation"], _gc_t[0], d])
def install_gc():
    if DIR and _on_gc not in gc.callbacks:
        gc.callbacks.append(_on_gc)
async def lag(name):
    if not DIR:
        return
    install_gc()
    while True:
        t = time.monotonic()
        await asyncio.sleep(0.005)
        late = time.monotonic() - t - 0.005
        if late > 0.015:
            _write(["lag", name, t, late])
def step(start, dur):
    install_gc()
    if DIR and dur > 0.03:
        _write(["step", start, dur])
