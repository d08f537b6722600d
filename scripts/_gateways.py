"""Start W gateway workers beside a running server, for benchmarks that try several W on one server.

    python scripts/_gateways.py ADDRESS PORT W PID_FILE

The same ``start_gateways`` as ``forerun serve --port PORT --api-workers W``, on
127.0.0.1 without an API key; once every worker serves, their pids go to
PID_FILE (space-separated).  Serves until SIGTERM or SIGINT, then stops them.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import threading

from ipc.gateway.process import start_gateways


def main(argv: list[str]) -> int:
    """Start the workers, write their pids, serve until a signal."""
    address, port, workers, pid_file = argv[1], int(argv[2]), int(argv[3]), argv[4]
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop.set())
    run_dir = tempfile.mkdtemp(prefix="fr-gw-")
    gateways = start_gateways(address, host="127.0.0.1", port=port, workers=workers, run_dir=run_dir)
    try:
        gateways.wait_ready()
        with open(pid_file + ".tmp", "w") as f:
            f.write(" ".join(str(p.pid) for p in gateways.procs))
        os.replace(pid_file + ".tmp", pid_file)
        stop.wait()
    finally:
        gateways.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
