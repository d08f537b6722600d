"""kernels.precompile: launches recorded once per specialization, compiled off the launching thread.

On the CPU Triton's compiler has no target, so these tests give ``compiled_ahead`` their own compile
function and check what it is handed; the GPU test compiles a real kernel ahead and checks that its
launch then compiles nothing and computes what torch does.
"""

from __future__ import annotations

import gc
import threading
import weakref

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from kernels.precompile import compiled_ahead, dry_run, enabled, specialization_key


def _scale(x_ptr, out_ptr, n, factor, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * factor, mask=offs < n)


# A compiled-kernel function whatever the interpreter setting (triton.jit gives an interpreted one under it).
SCALE = JITFunction(_scale)


def _launch(x, out, n, block=64, **options):
    SCALE[(triton.cdiv(n, block),)](x, out, n, 2.0, BLOCK=block, **options)


def _record(launches, compile_fn=None):
    """The compile calls ``compiled_ahead`` makes for ``launches()``, in the order of the launches (one worker:
    first in, first out), and its recorder."""
    calls = []

    def fake_compile(fn, args, kwargs, grid):
        calls.append((fn, args, kwargs, grid))
        if compile_fn is not None:
            compile_fn(fn, args, kwargs, grid)

    reports = []
    with compiled_ahead(compile_fn=fake_compile, threads=1, progress=lambda *r: reports.append(r)) as recorder:
        recorder.record(launches)
    # reported while the block's end waits: the compiles done so far, up to all of them
    assert reports[-1] == (len(calls), len(calls)) and reports == sorted(reports)
    assert {total for _, total in reports} == {len(calls)}
    return calls, recorder


def test_one_compile_per_specialization():
    bf16 = torch.zeros(256, dtype=torch.bfloat16)
    f32 = torch.zeros(256, dtype=torch.float32)
    out = torch.zeros(256, dtype=torch.float32)

    def launches():
        _launch(f32, out, 32)
        _launch(f32, out, 64)  # n another multiple of 16: the same kernel
        _launch(f32, out, 1)  # n == 1 is specialized
        _launch(f32, out, 17)  # not a multiple of 16
        _launch(f32, out, 32, block=128)  # another constexpr
        _launch(bf16, out, 32)  # another pointer dtype
        _launch(bf16[1:], out, 32)  # a pointer off 16-byte alignment
        _launch(f32, out, 32, num_warps=2)  # another launch option
        _launch(f32, out, 48)  # the first kernel again

    calls, recorder = _record(launches)
    assert recorder.launches == 9 and recorder.compiles == 7 == len(calls) and recorder.failed == 0
    fn, args, kwargs, grid = calls[0]
    assert fn is SCALE and grid == (1,) and kwargs == {"BLOCK": 64}
    x, o, n, factor = args
    assert (x.dtype, x.data_ptr(), o.dtype, n, factor) == (torch.float32, 0, torch.float32, 32, 2.0)
    misaligned = [c for c in calls if c[1][0].dtype == torch.bfloat16]
    assert [c[1][0].data_ptr() % 16 != 0 for c in misaligned] == [False, True]
    assert [c[2] for c in calls if "num_warps" in c[2]] == [{"BLOCK": 64, "num_warps": 2}]


def test_keys_follow_the_arguments_triton_specializes_on():
    x = torch.zeros(64)
    key = specialization_key(SCALE, (x, x, 32, 2.0), {"BLOCK": 64})
    assert key == specialization_key(SCALE, (x, x, 64, 3.0), {"BLOCK": 64})  # values Triton does not key on
    assert key == specialization_key(SCALE, (x, x), {"n": 48, "factor": 2.0, "BLOCK": 64})  # by keyword
    assert key != specialization_key(SCALE, (x, x, 2**40, 2.0), {"BLOCK": 64})  # a 64-bit integer
    assert specialization_key(SCALE, (x,), {"BLOCK": 64}) is None  # does not bind: no de-duplication


def test_tensor_descriptors_key_on_their_dtype_and_tile_never_their_values():
    """A TMA tensor descriptor specializes a kernel by its tensor's dtype and its tile; its key never formats the
    tensor (a repr copies a GPU tensor to the host, which breaks the dry run's capture)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    class Unprintable(torch.Tensor):
        def __repr__(self):
            raise AssertionError("the key formatted the tensor")

    x = torch.zeros(64, 64).as_subclass(Unprintable)
    key = specialization_key(SCALE, (TensorDescriptor.from_tensor(x, [16, 32]), x, 64, 2.0), {"BLOCK": 64})
    other = torch.ones(32, 128).as_subclass(Unprintable)
    assert key == specialization_key(SCALE, (TensorDescriptor.from_tensor(other, [16, 32]), x, 64, 2.0),
                                      {"BLOCK": 64})
    assert key != specialization_key(SCALE, (TensorDescriptor.from_tensor(x, [32, 32]), x, 64, 2.0), {"BLOCK": 64})


def test_records_hold_no_tensor_and_failures_are_left_for_the_launch():
    x = torch.zeros(4096)
    ref = weakref.ref(x)

    def failing(*_):
        raise RuntimeError("out of resources")

    calls, recorder = _record(lambda t=x: _launch(t, t, 4096), compile_fn=failing)
    assert recorder.compiles == 1 and recorder.failed == 1  # no exception out of the block
    del x
    gc.collect()
    assert ref() is None  # the stand-ins keep dtype and alignment, not the memory
    assert calls[0][1][0].dtype == torch.float32


def test_other_threads_launch_as_usual_and_the_patch_is_undone():
    x = torch.zeros(64)
    seen = []

    def from_another_thread():
        try:
            _launch(x, x, 64)  # not recorded: on a machine without a GPU the real launch fails
        except Exception as e:  # noqa: BLE001
            seen.append(type(e))

    def launches():
        t = threading.Thread(target=from_another_thread)
        t.start()
        t.join()
        _launch(x, x, 64)

    run = JITFunction.run
    calls, recorder = _record(launches)
    assert recorder.launches == 1 and len(calls) == 1
    assert JITFunction.run is run
    if not torch.cuda.is_available():
        assert seen  # the other thread reached Triton's own launch


def test_each_recorded_call_waits_for_its_own_kernels():
    """A recorded call's needs are the compiles of its launches (a specialization seen before shares its
    compile); waiting for them leaves the others compiling; the block's end waits for all."""
    x = torch.zeros(64)
    gate, started = threading.Event(), []

    def compile_fn(fn, args, kwargs, grid):
        started.append(kwargs["BLOCK"])
        if kwargs["BLOCK"] == 256:
            assert gate.wait(10)  # the second call's kernel takes its time

    reports = []
    with compiled_ahead(compile_fn=compile_fn, threads=2, progress=lambda *r: reports.append(r)) as ahead:
        first = ahead.record(lambda: (_launch(x, x, 64, block=64), _launch(x, x, 64, block=128)))
        second = ahead.record(lambda: (_launch(x, x, 64, block=256), _launch(x, x, 64, block=64)))
        assert len(first) == 2 and len(second) == 2 and second[1] is first[0]
        ahead.wait(first)
        assert all(f.done() for f in first) and not second[0].done()
        gate.set()
    assert second[0].done() and ahead.compiles == 3 and ahead.launches == 4
    assert reports[-1] == (3, 3)


def test_off_without_a_gpu_or_when_asked(monkeypatch):
    monkeypatch.setenv("FORERUN_COMPILE_THREADS", "0")
    assert not enabled()
    run = JITFunction.run
    with compiled_ahead() as recorder:
        assert JITFunction.run is run and not recorder.enabled
        assert recorder.record(lambda: 1 / 0) == []  # a pass made only to compile is skipped
    with compiled_ahead(threads=0) as recorder:  # or when the caller asks
        assert not recorder.enabled
    calls = []
    dry_run(lambda: calls.append(1), torch.device("cpu"))  # the CPU just calls it
    assert calls == [1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_compiled_ahead_then_launched_without_compiling():
    scale = JITFunction(_scale)  # its own kernel cache
    x = torch.randn(1000, device="cuda")
    out = torch.empty_like(x)
    def launches():
        for block in (64, 128, 256):
            _dry = torch.empty_like(x)
            scale[(triton.cdiv(1000, block),)](x, _dry, 1000, 2.0, BLOCK=block)

    with compiled_ahead(threads=4) as recorder:
        recorder.record(launches)
    assert recorder.compiles == 3 and recorder.failed == 0
    cache = scale.device_caches[torch.cuda.current_device()][0]
    assert len(cache) == 3
    for block in (64, 128, 256):
        out.zero_()
        scale[(triton.cdiv(1000, block),)](x, out, 1000, 2.0, BLOCK=block)
        torch.testing.assert_close(out, x * 2.0)
    assert len(cache) == 3  # every launch found its kernel

    # inside a dry run the torch ops are captured, not run: an index out of range asserts nothing
    table = torch.zeros(4, device="cuda")
    dry_run(lambda: table[torch.full((2,), 10**6, device="cuda")].sum(), torch.device("cuda"))
    torch.cuda.synchronize()
