"""Start a real `forerun serve` process for integration tests and stop it afterwards."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class ServerProcess:
    def __init__(self, *args: str, tmpdir: str, timeout: float = 300.0):
        self.address = f"ipc://{tmpdir}/c-{uuid.uuid4().hex[:8]}.sock"
        env = dict(os.environ, PYTHONPATH=ROOT, PYTHONUNBUFFERED="1", FORERUN_RUN_DIR=tmpdir)
        cmd = [sys.executable, "-m", "scheduler_proc.launch", "serve", "--address", self.address, "--quiet", *args]
        self.proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.log: list[str] = []
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError("server exited during start-up:\n" + "".join(self.log))
            self.log.append(line)
            if "ready at" in line:
                return
        raise TimeoutError("server not ready:\n" + "".join(self.log))

    def executor_pid(self) -> int:
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout.split()
        return int(out[0])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
