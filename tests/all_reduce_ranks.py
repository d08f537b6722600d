"""Two or more CUDA ranks check the one-shot all-reduce against NCCL's (``tests/test_one_shot_all_reduce.py``).

``python -m tests.all_reduce_ranks RANK SIZE STORE`` once per rank (rank r on cuda:r, ``--all-reduce one-shot``):

- eager, for float32 and bfloat16 and shapes from a few bytes to the whole buffer: float32 the same bits as NCCL's
  at 2 ranks (both compute a + b), bfloat16 within its rounding of the exact sum; every rank the same bits; a view
  that starts off a 16-byte boundary summed in place, its neighbour untouched;
- in one captured CUDA graph, two one-shot all-reduces back to back (a layer's two) and an NCCL one of a tensor past
  the buffer, replayed with new inputs each time, an eager one-shot call between replays.

Inputs are drawn from (rank, seed), so every rank knows every rank's inputs and the exact sum.  A failed check
raises: the rank exits non-zero with the traceback.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from executor_proc.parallel.group import TPGroup, init_group
from ipc.config import ONE_SHOT_MAX_BYTES

DTYPES = (torch.float32, torch.bfloat16)
REPLAYS = 6


def inputs(rank: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int, device: torch.device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 64 + rank)
    return torch.randn(shape, generator=g).to(dtype).to(device)


def shapes(dtype: torch.dtype) -> list[tuple[int, ...]]:
    """A few bytes, a decode step's rows, an odd row count, and the whole buffer."""
    return [(2, 3), (1, 896), (7, 4096), (ONE_SHOT_MAX_BYTES // (4096 * dtype.itemsize), 4096)]


def exact_sum(size: int, shape, dtype, seed: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The sum of every rank's inputs in float64, and the sum of their magnitudes (for rounding bounds)."""
    xs = [inputs(r, shape, dtype, seed, device).double() for r in range(size)]
    return sum(xs), sum(x.abs() for x in xs)


def check_sum(got: torch.Tensor, nccl: torch.Tensor, exact: torch.Tensor, magnitude: torch.Tensor, size: int,
              what: str) -> None:
    """float32 at 2 ranks: NCCL's bits; otherwise both within the dtype's rounding of the exact sum."""
    if got.dtype == torch.float32 and size == 2:
        assert torch.equal(got, nccl), f"{what}: not NCCL's bits, max diff {(got - nccl).abs().max().item()}"
    ulp = 2.0 ** -8 if got.dtype == torch.bfloat16 else 2.0 ** -24  # half a unit in the last place, relative
    bound = (size - 1) * ulp * magnitude + ulp * exact.abs() + 1e-30
    for name, t in (("one-shot", got), ("nccl", nccl)):
        err = (t.double() - exact).abs()
        assert (err <= 2 * bound).all(), f"{what}: {name} off the exact sum by {(err / bound).max().item():.2f} bounds"


def check_same_on_every_rank(group: TPGroup, t: torch.Tensor, what: str) -> None:
    rows = group.all_gather_columns(t.reshape(1, -1)).view(group.size, -1)
    assert all(torch.equal(rows[0], rows[r]) for r in range(1, group.size)), f"{what}: ranks differ"


def check_eager(group: TPGroup, device: torch.device) -> None:
    for dtype in DTYPES:
        for seed, shape in enumerate(shapes(dtype)):
            what = f"eager {dtype} {shape}"
            x = inputs(group.rank, shape, dtype, seed, device)
            assert group.one_shot.takes(x), what
            nccl = x.clone()
            dist.all_reduce(nccl)
            got = group.all_reduce(x.clone())
            check_sum(got, nccl, *exact_sum(group.size, shape, dtype, seed, device), group.size, what)
            check_same_on_every_rank(group, got, what)
    check_misaligned(group, device)


def check_misaligned(group: TPGroup, device: torch.device) -> None:
    """A float32 view one element into its tensor (4 bytes off 16): summed in place through a fresh tensor."""
    shape, seed = (4096,), 99
    whole = torch.full((1 + shape[0],), 7.0, device=device)
    view = whole[1:]
    view.copy_(inputs(group.rank, shape, torch.float32, seed, device))
    assert view.data_ptr() % 16 == 4
    nccl = view.clone()
    dist.all_reduce(nccl)
    assert group.all_reduce(view) is view
    check_sum(view, nccl, *exact_sum(group.size, shape, torch.float32, seed, device), group.size, "misaligned view")
    assert whole[0].item() == 7.0, "the element before the view was written"


def check_graph(group: TPGroup, device: torch.device) -> None:
    """A layer's two all-reduces (one shot) and one past the buffer (NCCL) in one graph, replayed with new inputs."""
    for dtype in DTYPES:
        shape, big_shape = (4, 896), (2 * ONE_SHOT_MAX_BYTES // (1024 * dtype.itemsize), 1024)  # twice the buffer
        static = torch.zeros(shape, dtype=dtype, device=device)
        out, big = torch.empty_like(static), torch.zeros(big_shape, dtype=dtype, device=device)
        assert group.one_shot.takes(out) and not group.one_shot.takes(big)

        def step() -> None:
            out.copy_(static)
            group.all_reduce(out)
            out.mul_(0.5)
            group.all_reduce(out)
            big.fill_(1.0)
            group.all_reduce(big)

        step()  # eager once before the capture, as executor_proc.step.graphs.GraphCapture does
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        for k in range(REPLAYS):
            what = f"graph {dtype} replay {k}"
            seed = 1000 + k
            static.copy_(inputs(group.rank, shape, dtype, seed, device))
            graph.replay()
            nccl = static.clone()
            dist.all_reduce(nccl)
            nccl.mul_(0.5)
            dist.all_reduce(nccl)
            exact, magnitude = exact_sum(group.size, shape, dtype, seed, device)
            check_sum(out, nccl, exact, magnitude * 1.5, group.size, what)  # two sums: a looser bound
            assert (big == group.size).all(), f"{what}: the NCCL all-reduce in the graph"
            check_same_on_every_rank(group, out, what)
            between = group.all_reduce(static.clone())  # an eager call between replays
            check_same_on_every_rank(group, between, f"{what}, eager between replays")


def main(argv: list[str]) -> None:
    rank, size, store = int(argv[0]), int(argv[1]), argv[2]
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    group = init_group(f"file://{store}", rank, size, device, all_reduce="one-shot")
    assert group.one_shot is not None, "one-shot is not on"
    check_eager(group, device)
    check_graph(group, device)
    torch.cuda.synchronize(device)
    group.barrier()
    print(f"rank {rank}: one-shot all-reduce checks passed", flush=True)
    group.exit_process(0)


if __name__ == "__main__":
    main(sys.argv[1:])
