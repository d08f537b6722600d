"""Front-door fairness and overload, against a real server with the scripted executor.

Flood: one client (its own process) sends ``--frames`` junk frames as fast as
the server takes them, while another streams requests (batched deltas) one
after another; the streamer's largest gap between two token messages is the
figure (with 1 ms steps, a gap is normally 1 ms).

Overload: a second server whose steps never end (``--scripted-step-ms 60000``,
one slot) gets ``--max-waiting`` + ``--overload-extra`` requests: every one
past the limit must be refused with ``overloaded`` at once; the scheduler's
RSS is read before and with the waiting queue full.

    .venv/bin/python scripts/bench_flood.py --frames 200000 --json flood.json
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from executor_proc.testing.scripted import ScriptedRunner, expected_output  # noqa: E402
from ipc import protocol as p  # noqa: E402
from ipc.client.raw import RawConnection  # noqa: E402
from scripts._bench_util import format_table, percentile, write_json  # noqa: E402
from tests.server_proc import ServerProcess  # noqa: E402

FLOODER = r"""
import sys, time, zmq
sock = zmq.Context().socket(zmq.DEALER)
sock.connect(sys.argv[1])
t0 = time.monotonic()
for i in range(int(sys.argv[2])):
    sock.send(b"\xc1junk")
sock.setsockopt(zmq.LINGER, -1)
sock.close()  # returns once every frame has been handed to the server
print(time.monotonic() - t0)
"""
PROMPT = [5, 6, 7, 8]
STREAM_MAX_TOKENS = 300


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


async def stream_during_flood(address: str, frames: int) -> dict:
    """Stream requests back to back while the flooder runs; the gaps between token messages."""
    script = ScriptedRunner(1, 1, 1, vocab_size=1000, eos_token_id=2)
    gaps: list[float] = []
    ok = True
    async with RawConnection(address, timeout=30) as conn:
        await conn.hello("streamer", batch_deltas=True)
        flooder = subprocess.Popen([sys.executable, "-c", FLOODER, address, str(frames)], stdout=subprocess.PIPE,
                                   text=True)
        t_start = time.monotonic()
        last, n = None, 0
        while flooder.poll() is None or n < 2:
            want, _ = expected_output(script.token_at, seed=n, prompt_len=len(PROMPT), max_tokens=STREAM_MAX_TOKENS,
                                      max_model_len=4096, eos_token_ids=(2,))
            await conn.send(p.Generate(f"s{n}", PROMPT, p.SamplingParams(max_tokens=STREAM_MAX_TOKENS, seed=n)))
            got: list[int] = []
            while True:
                msg = await conn.recv()
                now = time.monotonic()
                if last is not None:
                    gaps.append(now - last)
                last = now
                if isinstance(msg, p.TokenDeltas):
                    got += msg.token_ids[0]
                elif isinstance(msg, p.Finished):
                    got += msg.token_ids
                    break
                else:
                    raise RuntimeError(f"unexpected {msg!r}")
            ok = ok and got == want
            n += 1
        flood_s = float(flooder.communicate()[0])
    return {"frames_sent": frames, "flood_s": flood_s, "stream_s": time.monotonic() - t_start, "stream_requests": n,
            "stream_ok": ok, "max_gap_during_flood_s": max(gaps), "p99_gap_s": percentile(gaps, 99)}


async def overload(srv: ServerProcess, max_waiting: int, extra: int) -> dict:
    rss_before = rss_mib(srv.proc.pid)
    async with RawConnection(srv.address, timeout=30) as conn:
        await conn.hello("overload", batch_deltas=True)
        t0 = time.monotonic()
        for i in range(max_waiting + 1 + extra):  # one runs (the only slot), max_waiting wait
            await conn.send(p.Generate(f"o{i}", PROMPT * 4, p.SamplingParams(max_tokens=16)))
        refusals = 0
        while refusals < extra:
            msg = await conn.recv()
            if isinstance(msg, p.Error) and msg.code == "overloaded":
                refusals += 1
        elapsed = time.monotonic() - t0
        stats = await conn.stats()
        rss_full = rss_mib(srv.proc.pid)
    return {"max_waiting": max_waiting, "overload_extra": extra, "overloaded_refusals": refusals,
            "num_waiting": stats.num_waiting, "refused_within_s": elapsed, "scheduler_rss_idle_mib": rss_before,
            "scheduler_rss_queue_full_mib": rss_full}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frames", type=int, default=200_000, help="junk frames the flooder sends")
    ap.add_argument("--step-ms", type=float, default=1.0, help="scripted step time of the flood server")
    ap.add_argument("--max-waiting", type=int, default=4096, help="the overload server's --max-waiting")
    ap.add_argument("--overload-extra", type=int, default=100, help="requests sent past the limit")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the figures here")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="frb", dir="/tmp")
    srv = ServerProcess("--load-format", "scripted", "--scripted-step-ms", str(args.step_ms), tmpdir=tmp, timeout=120)
    try:
        result = asyncio.run(stream_during_flood(srv.address, args.frames))
    finally:
        srv.stop()
    srv = ServerProcess("--load-format", "scripted", "--scripted-step-ms", "60000", "--max-num-seqs", "1",
                        "--max-waiting", str(args.max_waiting), "--shutdown-timeout", "0", tmpdir=tmp, timeout=120)
    try:
        result.update(asyncio.run(overload(srv, args.max_waiting, args.overload_extra)))
    finally:
        srv.stop()
    print(format_table([(k, f"{v:.4f}" if isinstance(v, float) else str(v)) for k, v in result.items()],
                       title="flood and overload (times in s, memory in MiB)"))
    if args.json:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
