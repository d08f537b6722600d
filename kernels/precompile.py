"""Compile Triton kernels in parallel, ahead of their first launch.

Triton compiles a kernel's specialization at its first launch, on the launching thread.  A start-up
meets a few hundred for the first time (the tuner's candidates, every graph's warm-up), 0.1 to 1 s
each, one after another: most of an 8B start-up from an empty cache.  Inside :func:`compiled_ahead`
Triton launches on the calling thread are *recorded* instead: each distinct specialization is handed
to a thread pool as soon as it is seen (``JITFunction.run(..., warmup=True)``: compile, no launch;
the compiler spends most of its time outside the GIL, in MLIR passes and ptxas), and leaving the
block waits for them, so that the real run finds every kernel in Triton's cache.

The recording pass skips the kernels, so their outputs hold whatever the allocator left there:
code run inside the block must not read them back on the host, and torch ops that would feed them
to a value-checking op (an index) should run inside :func:`dry_run`, which captures them into a
scratch CUDA graph that is never replayed.  A specialization the recording misjudges is simply
compiled at its launch, as before; a compile that fails is left for that launch to report.

Off (everything compiles at its launch) without CUDA, under the interpreter, and with
``FORERUN_COMPILE_THREADS=0``; that variable also sets the pool's size (default: the CPUs, at most 32).
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Callable, Iterator, Optional

import torch

from triton.runtime.jit import JITFunction, MockTensor

MAX_THREADS = 32
STAGE = "compiling kernels"  # what a start-up calls the wait for these compiles in its progress


class _Pointer(MockTensor):
    """A tensor argument as Triton specializes it (dtype, 16-byte alignment), holding none of its memory."""

    def __init__(self, t: torch.Tensor):
        super().__init__(t.dtype, list(t.shape))
        self._ptr = 0 if t.data_ptr() % 16 == 0 else 8

    def data_ptr(self) -> int:
        return self._ptr


def compile_threads() -> int:
    """The pool's size: ``FORERUN_COMPILE_THREADS``, else the CPUs this process may use (at most 32)."""
    value = os.environ.get("FORERUN_COMPILE_THREADS", "")
    if value:
        if not value.isdigit():
            raise ValueError(f"FORERUN_COMPILE_THREADS must be a number of threads (0: off), not {value!r}")
        return int(value)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(MAX_THREADS, cpus)


def enabled() -> bool:
    return torch.cuda.is_available() and compile_threads() > 0 and os.environ.get("TRITON_INTERPRET") != "1"


class Recorder:
    """What :func:`compiled_ahead` yields: counts of what it saw and compiled."""

    def __init__(self, submit: Callable, enabled: bool = True):
        self.submit = submit
        self.enabled = enabled  # False: the block runs as usual (then skip a pass made only to compile)
        self.seen: set = set()
        self.launches = 0  # launches recorded
        self.compiles = 0  # distinct specializations handed to the pool
        self.failed = 0  # of them, compiles that raised (left for their launch)

    def record(self, fn, args: tuple, kwargs: dict, grid) -> None:
        self.launches += 1
        key = specialization_key(fn, args, kwargs)
        if key is not None and key in self.seen:
            return
        self.seen.add(key)
        self.compiles += 1
        with contextlib.suppress(Exception):  # create fn's per-device cache here, not racing in two workers
            fn.device_caches[torch.cuda.current_device()]
        self.submit(fn, tuple(_stand_in(a) for a in args), {k: _stand_in(v) for k, v in kwargs.items()}, grid)


@contextlib.contextmanager
def compiled_ahead(compile_fn: Optional[Callable] = None, threads: Optional[int] = None,
                   progress: Optional[Callable[[int, int], None]] = None) -> Iterator[Recorder]:
    """Within the block, this thread's Triton launches are recorded, not launched, and their kernels compiled
    in a pool of ``threads``; leaving it waits for them, reporting ``progress(done, total)`` as they finish.  A
    no-op block where :func:`enabled` is false (then the recorder stays empty and the kernels launch as usual).
    ``compile_fn(fn, args, kwargs, grid)`` replaces Triton's compile (tests)."""
    threads = compile_threads() if threads is None else threads
    if compile_fn is None and not enabled():
        yield Recorder(lambda *a: None, enabled=False)
        return
    run = JITFunction.run
    compile_fn = compile_fn or (lambda fn, args, kwargs, grid: run(fn, *args, grid=grid, warmup=True, **kwargs))
    on_cuda = torch.cuda.is_available()
    pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="triton-compile",  # workers on this device
                              initializer=torch.cuda.set_device if on_cuda else None,
                              initargs=(torch.cuda.current_device(),) if on_cuda else ())
    futures = []
    recorder = Recorder(lambda *job: futures.append(pool.submit(_quietly, compile_fn, *job)))
    recording = threading.get_ident()

    def recording_run(fn, *args, grid, warmup, **kwargs):
        if threading.get_ident() != recording or warmup:
            return run(fn, *args, grid=grid, warmup=warmup, **kwargs)
        recorder.record(fn, args, kwargs, grid)
        return None

    JITFunction.run = recording_run
    try:
        yield recorder
    finally:
        JITFunction.run = run
        for done, future in enumerate(as_completed(futures), 1):
            recorder.failed += not future.result()
            if progress is not None:
                progress(done, len(futures))
        pool.shutdown()


def _quietly(compile_fn, fn, args, kwargs, grid) -> bool:
    try:
        compile_fn(fn, args, kwargs, grid)
        return True
    except Exception:
        return False


def dry_run(fn: Callable[[], object], device: torch.device) -> None:
    """Call ``fn`` inside a capture into a scratch CUDA graph that is never replayed (its torch ops are
    recorded, not run: inside :func:`compiled_ahead` they would read what the skipped kernels never wrote);
    on the CPU, call it (there nothing is skipped).  Unlike ``torch.cuda.graph`` it neither synchronizes
    nor collects garbage: it runs once per graph of the start-up."""
    if device.type != "cuda":
        fn()
        return
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        graph.capture_begin(capture_error_mode="relaxed")
        try:
            torch.zeros(1, device=device)  # one node: a graph of skipped Triton launches alone would be empty
            fn()
        finally:
            with warnings.catch_warnings():  # and torch warns about an empty graph
                warnings.filterwarnings("ignore", "The CUDA Graph is empty", UserWarning)
                graph.capture_end()
    torch.cuda.current_stream(device).wait_stream(stream)


def specialization_key(fn, args: tuple, kwargs: dict) -> Optional[tuple]:
    """What Triton compiles a launch of ``fn`` for, as far as the arguments show it: constexpr values, pointer
    dtypes and 16-byte alignment, integers' 1 / multiple-of-16 / 32-bit ranges, the launch options.  None
    where the arguments do not bind (then the launch is compiled without de-duplication)."""
    try:
        names = {p.name for p in fn.params}
        options = tuple(sorted((k, repr(v)) for k, v in kwargs.items() if k not in names))
        bound = fn.signature.bind(*args, **{k: v for k, v in kwargs.items() if k in names})
        bound.apply_defaults()
        return (fn, tuple(_spec(p, bound.arguments[p.name]) for p in fn.params), options)
    except Exception:
        return None


def _spec(param, value) -> tuple:
    if param.is_constexpr:
        return ("c", repr(value))
    if hasattr(value, "data_ptr"):
        return ("p", str(value.dtype), value.data_ptr() % 16 == 0)
    if isinstance(value, bool):
        return ("b",)
    if isinstance(value, int):
        in_32 = -2**31 <= value < 2**31
        return ("i", in_32) if param.do_not_specialize else ("i", in_32, value == 1, value % 16 == 0)
    if isinstance(value, float):
        return ("f",)
    return ("o", repr(value))


def _stand_in(value):
    return _Pointer(value) if isinstance(value, torch.Tensor) else value
