"""A data-parallel replica: one scheduler (and its executor group) behind the router, as its own process.

``python -m scheduler_proc.replica CONFIG_JSON`` runs a :class:`~scheduler_proc.server.Server` on an ipc://
address in the router's run directory; the router (``scheduler_proc/replica_router.py``) spawns it with
:func:`spawn_replica`, is its only client, and restarts it when it dies.  It differs from ``forerun serve`` in
three things: it names itself on stderr, writes no address file, and, when its executor fails for good, exits
without failing its requests (``ServerConfig.replica``): the router sends them to another replica.

On CUDA replica ``i`` of ``N``, each ``T`` ranks of tensor parallelism, sees GPUs ``first + i*T .. first +
(i+1)*T - 1`` of those the router sees (``--device cuda:first``), through ``CUDA_VISIBLE_DEVICES``, and runs
on its ``cuda:0``: :func:`replica_gpus`.  On the CPU the replicas share the cores.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import threading
from typing import Optional, Sequence

import msgspec

from scheduler_proc.config import ServerConfig
from scheduler_proc.executor_process import PROJECT_ROOT, die_with_parent


def replica_gpus(num_replicas: int, tensor_parallel_size: int, device: str,
                 visible: Optional[Sequence[str]]) -> list[Optional[str]]:
    """Each replica's ``CUDA_VISIBLE_DEVICES`` (None on the cpu), from the GPUs this process sees (``visible``,
    None when they cannot be counted); ValueError with one line when they do not suffice, or past the bounds
    (check_replica_count)."""
    check_replica_count(num_replicas, device)
    if not device.startswith("cuda"):
        return [None] * num_replicas
    kind, _, index = device.partition(":")
    if not (device == "cuda" or (kind == "cuda" and index.isdigit())):
        raise ValueError(f"--device must be cpu, cuda or cuda:N, got {device!r}")
    first, tp = int(index or 0), tensor_parallel_size
    if visible is None:
        raise ValueError(f"--data-parallel-size {num_replicas} --device {device}: cannot count this machine's GPUs "
                         "(no nvidia-smi: maybe it has none; --device cpu runs without one); where it has them, set "
                         "CUDA_VISIBLE_DEVICES")
    if first + num_replicas * tp > len(visible):
        raise ValueError(f"--data-parallel-size {num_replicas} x --tensor-parallel-size {tp} needs "
                         f"{num_replicas * tp} GPUs from cuda:{first}; {len(visible)} are visible")
    return [",".join(visible[first + i * tp: first + (i + 1) * tp]) for i in range(num_replicas)]


def check_replica_count(num_replicas: int, device: str) -> None:
    """--data-parallel-size in [1, MAX_DATA_PARALLEL], and on the cpu at most PER_CPU per CPU (the replicas share the
    cores: more only add memory and start-up time); checked before any replica starts (unbounded, 99999 would
    launch replicas until the host ran out).  ValueError with one line."""
    from scheduler_proc.cli_flags import MAX_DATA_PARALLEL, PER_CPU, usable_cpus

    if num_replicas < 1:
        raise ValueError(f"--data-parallel-size must be at least 1, got {num_replicas}")
    if num_replicas > MAX_DATA_PARALLEL:
        raise ValueError(f"--data-parallel-size must be in [1, {MAX_DATA_PARALLEL}], got {num_replicas}")
    cpus = usable_cpus()
    if not device.startswith("cuda") and num_replicas > PER_CPU * cpus:
        raise ValueError(f"--data-parallel-size must be in [1, {PER_CPU * cpus}] on the cpu ({PER_CPU} per CPU; "
                         f"{cpus} CPU{'s' if cpus > 1 else ''} here, shared by the replicas), got {num_replicas}")


def check_cpu_ranks(num_replicas: int, tensor_parallel_size: int, device: str) -> None:
    """On the cpu, every replica's every tensor-parallel rank is a process on the same cores: at most PER_CPU per CPU
    of them (each imports torch, ~2 s and ~100 MB, before its shard is even checked).  ValueError with one line."""
    from scheduler_proc.cli_flags import PER_CPU, usable_cpus

    ranks, cpus = num_replicas * tensor_parallel_size, usable_cpus()
    if device.startswith("cuda") or tensor_parallel_size == 1 or ranks <= PER_CPU * cpus:
        return
    what = f"--tensor-parallel-size {tensor_parallel_size}" + (
        f" x --data-parallel-size {num_replicas}" if num_replicas > 1 else "")
    raise ValueError(f"{what} starts {ranks} executor processes on the cpu; at most {PER_CPU * cpus} run there "
                     f"({PER_CPU} per CPU; {cpus} CPU{'s' if cpus > 1 else ''} here)")


def visible_gpus() -> Optional[list[str]]:
    """The GPUs this process may use: ``CUDA_VISIBLE_DEVICES`` if set, else nvidia-smi's list (None: unknown)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip()]
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return [line.strip() for line in out.splitlines() if line.strip()]


def replica_config(cfg: ServerConfig, index: int, address: str, gpus: Optional[str],
                   replicas: int = 1) -> ServerConfig:
    """Replica ``index``'s configuration of ``replicas``: the router's, on its own address (and GPUs, seen as
    cuda:0...); without GPUs the replicas' weights share the host's memory (``host_replicas``)."""
    executor = msgspec.structs.replace(cfg.executor, replica=index, host_replicas=replicas if gpus is None else 1)
    if gpus is not None:
        executor = msgspec.structs.replace(executor, device="cuda:0")
    return msgspec.structs.replace(cfg, client_address=address, replica=index, run_dir=None, executor=executor,
                                   step_log=f"{cfg.step_log}.{index}" if cfg.step_log else None)


def spawn_replica(cfg: ServerConfig, gpus: Optional[str], run_dir: str) -> subprocess.Popen:
    """``python -m scheduler_proc.replica CONFIG_JSON``, killed by the kernel when this process dies; its run
    directory (its executor's sockets) is made under ``run_dir``, the router's, so that a replica killed before it
    could remove its own leaves nothing once the router is gone.  In a session of its own: the router alone hears
    a signal sent to its process group (``kill -TERM -PGID``, a terminal's Ctrl-C) and passes it on once; a
    replica hearing it too took the router's SIGTERM for a second one, which stops at once."""
    env = dict(os.environ, FORERUN_RUN_DIR=run_dir)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [PROJECT_ROOT, env.get("PYTHONPATH")]))
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    cmd = [sys.executable, "-m", "scheduler_proc.replica", msgspec.json.encode(cfg).decode()]
    return subprocess.Popen(cmd, env=env, preexec_fn=_replica_preexec, start_new_session=True)


def refusal_file(run_dir: str, index: int) -> str:
    """Where replica ``index`` leaves the reason it could not start, for the router to say once."""
    return os.path.join(run_dir, f"replica-{index}.refusal")


def report_refusal(index: int, message: str, say) -> None:
    """A replica's start-up refusal (the flags as typed): left in the router's run directory, which says the first
    one it finds (the replicas of one configuration mostly refuse alike: said by each, a line per replica); said
    here where there is none."""
    run_dir = os.environ.get("FORERUN_RUN_DIR")
    if run_dir and os.path.isdir(run_dir):
        with open(refusal_file(run_dir, index), "w") as f:
            f.write(message)
    else:
        say(message)


def _replica_preexec() -> None:
    """Runs in the child before exec: die with the router, ignore SIGINT (the router acts on a Ctrl-C), and take
    SIGTERM's default until main() handles it.  Ignored, as an executor ignores it, a SIGTERM from a router that
    stops while this replica still imports would be lost: the replica would start anyway, and the router wait out
    --shutdown-timeout + 5 s before killing it."""
    die_with_parent()
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def main(argv: list[str]) -> int:
    import uvloop

    from ipc.models import resolve_model
    from scheduler_proc import server as server_module
    from scheduler_proc.cli_flags import in_flag_names
    from scheduler_proc.frontend import StartupError
    from scheduler_proc.server import Server, say

    cfg = msgspec.json.decode(argv[0], type=ServerConfig)
    server_module.SPEAKER = f"forerun: replica {cfg.replica}"
    signal.signal(signal.SIGTERM, _raise_interrupt)  # until the event loop handles it
    sys.unraisablehook = _quiet_interrupts
    server = None
    try:
        model = resolve_model(cfg.model, cfg.executor.load_format, cfg.tokenizer)
        server = Server(cfg, model)
        server.bind()
        ready = server.start_executor()
        if _stop_asked.is_set():  # its KeyboardInterrupt was raised where Python drops exceptions (a fork hook)
            raise KeyboardInterrupt
    except (StartupError, ValueError, RuntimeError, TimeoutError, KeyboardInterrupt) as e:
        for sig in (signal.SIGINT, signal.SIGTERM):  # a stop now (the router's, a Ctrl-C) must not cut the report
            signal.signal(sig, lambda signum, frame: _stop_asked.set())
        if not isinstance(e, KeyboardInterrupt):  # stopped while starting (the router's or the user's): the router says
            report_refusal(cfg.replica, in_flag_names(str(e)) or f"{type(e).__name__} while starting", say)
        if server is not None:
            server.close()
        return 1
    # From here SIGTERM asks for the graceful shutdown: noted now, acted on once the event loop runs (as in launch).
    signal.signal(signal.SIGTERM, lambda signum, frame: _stop_asked.set())
    say(f"serving on {ready.device} ({ready.dtype}), {ready.num_kv_blocks} KV blocks of {cfg.executor.block_size}"
        f"{cfg.executor.speculative.banner()}")

    async def run() -> int:
        import asyncio

        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, server.begin_shutdown)
        if _stop_asked.is_set():
            server.begin_shutdown()
        return await server.serve()

    gc.freeze()
    try:
        return uvloop.run(run())
    except KeyboardInterrupt:
        return 1
    finally:
        server.close()


_stop_asked = threading.Event()  # a SIGTERM came: whatever became of the KeyboardInterrupt raised for it


def _raise_interrupt(signum, frame) -> None:
    """SIGTERM while starting: unwind the start (KeyboardInterrupt), and note it, for an interrupt that lands where
    Python only reports exceptions (an at-fork hook while the executor is spawned) and is lost."""
    _stop_asked.set()
    raise KeyboardInterrupt


def _quiet_interrupts(unraisable) -> None:
    """sys.unraisablehook: a KeyboardInterrupt Python could not raise is noted in _stop_asked already, and no
    traceback for the operator; anything else is reported as usual."""
    if not issubclass(unraisable.exc_type, KeyboardInterrupt):
        sys.__unraisablehook__(unraisable)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
