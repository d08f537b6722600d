"""Compile Triton kernels in parallel, ahead of their first launch.

Triton compiles a kernel's specialization at its first launch, on the launching thread, and at its
first launch loads it and builds its launcher (a small C extension, with the host's compiler).  A
start-up meets a few hundred kernels for the first time (the tuner's candidates, every graph's
warm-up), 0.1 to 1 s each, one after another: most of an 8B start-up from an empty cache.

:func:`compiled_ahead` opens a thread pool; :meth:`Compiles.record` runs a call with its Triton
launches *recorded* instead: each distinct specialization goes to the pool as soon as it is seen
(``JITFunction.run(..., warmup=True)``: compile, no launch; then the load and the launcher; the
compiler spends much of its time outside the GIL, in MLIR passes, ptxas and the C compiler), and
:meth:`Compiles.wait` blocks until the kernels of one recorded call are ready.  A start-up records
all its work first, then runs it piece by piece, each piece waiting only for its own kernels, so the
GPU work on the first pieces (timing, capturing) overlaps the compiles of the later ones.

The recording pass skips the kernels, so their outputs hold whatever the allocator left there:
a recorded call must not read them back on the host, and torch ops that would feed them to a
value-checking op (an index) should run inside :func:`dry_run`, which captures them into a scratch
CUDA graph that is never replayed.  A specialization the recording misjudges is simply compiled at
its launch, as before; a compile that fails is left for that launch to report.

Off (everything compiles at its launch; recorded calls are skipped) without CUDA, under the
interpreter, and with ``FORERUN_COMPILE_THREADS=0``; that variable also sets the pool's size
(default: the CPUs, at most 32).
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait as wait_futures
from typing import Callable, Iterator, Optional

import torch

from triton.runtime.jit import JITFunction, MockTensor

from kernels.capture import capturing

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


class Compiles:
    """What :func:`compiled_ahead` yields: :meth:`record` a call's launches (their kernels start compiling),
    :meth:`wait` for the kernels one of them needs; counts of what it saw and compiled."""

    def __init__(self, pool: Optional[ThreadPoolExecutor], compile_fn: Callable,
                 progress: Optional[Callable[[int, int], None]]):
        self.enabled = pool is not None  # False: record() skips its call (a pass made only to compile)
        self._pool, self._compile_fn, self._progress = pool, compile_fn, progress
        self._futures: dict = {}  # specialization key -> its compile
        self._all: list[Future] = []
        self._recording: Optional[int] = None  # the thread whose launches are recorded now
        self._needs: list[Future] = []  # the compiles the call being recorded needs
        self.launches = 0  # launches recorded
        self.compiles = 0  # distinct specializations handed to the pool
        self.failed = 0  # of them, compiles that raised (left for their launch), counted when the block ends

    def record(self, fn: Callable[[], object]) -> list[Future]:
        """Call ``fn`` with this thread's Triton launches recorded instead of launched, each new specialization
        handed to the pool; returns the compiles its launches need (for :meth:`wait`).  Where compiling ahead
        is off, ``fn`` is not called."""
        if not self.enabled:
            return []
        needs: list[Future] = []
        self._needs, self._recording = needs, threading.get_ident()
        try:
            fn()
        finally:
            self._recording = None
        return needs

    def wait(self, needs: list[Future]) -> None:
        """Block until the compiles in ``needs`` are done, reporting progress while it blocks."""
        pending = [f for f in needs if not f.done()]
        while pending:
            self._report()
            pending = list(wait_futures(pending, return_when=FIRST_COMPLETED).not_done)
        if needs is self._all:
            self._report()

    def _report(self) -> None:
        if self._progress is not None:
            self._progress(sum(f.done() for f in self._all), len(self._all))

    def _launch(self, fn, args: tuple, kwargs: dict, grid) -> None:
        self.launches += 1
        key = specialization_key(fn, args, kwargs)
        future = self._futures.get(key) if key is not None else None
        if future is None:
            self.compiles += 1
            with contextlib.suppress(Exception):  # create fn's per-device cache here, not racing in two workers
                fn.device_caches[torch.cuda.current_device()]
            stand_ins = tuple(_stand_in(a) for a in args), {k: _stand_in(v) for k, v in kwargs.items()}
            future = self._pool.submit(_quietly, self._compile_fn, fn, *stand_ins, grid)
            self._all.append(future)
            if key is not None:
                self._futures[key] = future
        self._needs.append(future)

    def _finish(self) -> None:
        if self.enabled:
            self.wait(self._all)
            self.failed = sum(not f.result() for f in self._all)
            self._pool.shutdown()


@contextlib.contextmanager
def compiled_ahead(compile_fn: Optional[Callable] = None, threads: Optional[int] = None,
                   progress: Optional[Callable[[int, int], None]] = None) -> Iterator[Compiles]:
    """Within the block, :meth:`Compiles.record` runs a call with this thread's Triton launches recorded, not
    launched, their kernels compiled in a pool of ``threads``, and :meth:`Compiles.wait` waits for the ones a
    recorded call needs (so that work on the first kernels overlaps the compiles of the rest); leaving the
    block waits for all.  ``progress(done, total)``: the compiles, reported while something waits for them.
    Where :func:`enabled` is false or ``threads`` is 0 the block compiles nothing ahead (kernels compile at their
    launch).
    ``compile_fn(fn, args, kwargs, grid)`` replaces Triton's compile (tests)."""
    threads = compile_threads() if threads is None else threads
    if compile_fn is None and (threads == 0 or not enabled()):
        yield Compiles(None, lambda *a: None, progress)
        return
    run = JITFunction.run
    compile_fn = compile_fn or (lambda fn, args, kwargs, grid: _load(run(fn, *args, grid=grid, warmup=True,
                                                                         **kwargs)))
    on_cuda = torch.cuda.is_available()
    pool = ThreadPoolExecutor(max(1, threads), thread_name_prefix="triton-compile",  # workers on this device
                              initializer=torch.cuda.set_device if on_cuda else None,
                              initargs=(torch.cuda.current_device(),) if on_cuda else ())
    compiles = Compiles(pool, compile_fn, progress)

    def recording_run(fn, *args, grid, warmup, **kwargs):
        if warmup or compiles._recording != threading.get_ident():
            return run(fn, *args, grid=grid, warmup=warmup, **kwargs)
        compiles._launch(fn, args, kwargs, grid)
        return None

    JITFunction.run = recording_run
    try:
        yield compiles
    finally:
        JITFunction.run = run
        compiles._finish()


def _load(kernel) -> None:
    """Load a compiled kernel as its first launch would: its module into the device, and its launcher (a small
    C extension per argument signature that Triton builds with the host compiler: a quarter second each from an
    empty cache, on the launching thread if not here)."""
    init = getattr(kernel, "_init_handles", None)  # Triton's own, private: skipped if it goes away
    if init is not None:
        init()


def _quietly(compile_fn, fn, args, kwargs, grid) -> bool:
    try:
        compile_fn(fn, args, kwargs, grid)
        return True
    except Exception:
        return False


def dry_run(fn: Callable[[], object], device: torch.device, scratch: Optional[list] = None) -> None:
    """Call ``fn`` inside a capture into a scratch CUDA graph that is never replayed (its torch ops are
    recorded, not run: inside :func:`compiled_ahead` they would read what the skipped kernels never wrote);
    on the CPU, call it (there nothing is skipped).

    ``scratch``: a list that keeps the scratch graphs of one pass alive, all in the first one's memory pool,
    so that each reuses what the last freed.  A scratch graph dropped at once leaves its pool to be freed by
    the next ``empty_cache``, which no capture may call: a pass of a hundred dry runs then held a hundred
    pools' memory at once (gigabytes at 256 slots)."""
    if device.type != "cuda":
        fn()
        return
    graph = torch.cuda.CUDAGraph()
    pool = scratch[0].pool() if scratch else None
    with warnings.catch_warnings():  # torch warns about an empty graph
        warnings.filterwarnings("ignore", "The CUDA Graph is empty", UserWarning)
        with capturing(graph, device, pool=pool, mode="relaxed"):
            torch.zeros(1, device=device)  # one node: a graph of skipped Triton launches alone would be empty
            fn()
    if scratch is not None:
        scratch.append(graph)


def specialization_key(fn, args: tuple, kwargs: dict) -> Optional[tuple]:
    """What Triton compiles a launch of ``fn`` for, as far as the arguments show it: constexpr values, pointer
    dtypes and 16-byte alignment, integers' 1 / multiple-of-16 / 32-bit ranges, the launch options.  None
    where the arguments do not bind (then the launch is compiled without de-duplication)."""
    try:  # bound by hand: inspect's bind costs as much as the rest of a recorded launch
        params = fn.params
        names = {p.name for p in params}
        options = tuple(sorted((k, repr(v)) for k, v in kwargs.items() if k not in names))
        if len(args) > len(params):
            return None
        values = []
        for i, param in enumerate(params):
            if i < len(args):
                value = args[i]
            elif param.name in kwargs:
                value = kwargs[param.name]
            elif param.has_default:
                value = param.default
            else:
                return None
            values.append(_spec(param, value))
        return (fn, tuple(values), options)
    except Exception:
        return None


def _spec(param, value) -> tuple:
    if param.is_constexpr:
        return ("c", repr(value))
    if hasattr(value, "block_shape") and hasattr(value, "base"):  # a tensor descriptor (TMA): its dtype and tile
        # (never its repr: that prints the tensor, a copy to the host that would break a dry run's capture)
        return ("d", str(value.base.dtype), tuple(value.block_shape), str(getattr(value, "padding", "")))
    if hasattr(value, "data_ptr"):
        aligned = None if getattr(param, "do_not_specialize_on_alignment", False) else value.data_ptr() % 16 == 0
        return ("p", str(value.dtype), aligned)
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
