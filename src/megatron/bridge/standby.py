"""Workers forked from a pre-imported standby process, so that a (re)started rank does not import torch again.

The failure: torchrun and ``ft_launcher`` start every worker as a fresh interpreter, at the job's start and again at
every in-job restart. Before it can train, each one imports torch and megatron-core: 4 to 5 CPU-seconds per rank on
a small node, paid again by every rank after every fault (issue: restarts must not pay the whole import cost again).

What this does: at the first worker start, the launcher starts one standby process that imports what every worker
imports (:data:`PRELOAD`) and then waits. Each worker is then forked from it, already imported, and runs its entry
point (``python -u script.py ...`` or ``python -u -m module ...``) with the environment, working directory, output
files, session and signal state the launcher gave it, exactly as if it had been started with ``exec``; the launcher
waits on it, signals its process group and reads its exit code as before (the standby double-forks; the launcher is
made the workers' child subreaper, so they are its children). Where the entry point is not the launcher's own
Python, or the standby cannot be used (not Linux, it died, CUDA got initialised in it), the worker is started the
usual way: never a failed start because of this module.

The standby never initialises CUDA (device queries go through NVML, ``PYTORCH_NVML_BASED_CUDA_CHECK=1``), so a
forked worker can use its GPU; it refuses to serve if CUDA was initialised anyway. ``--no-preload-workers`` on
``megatron.bridge.launch`` and ``megatron.bridge.ft_launch`` turns it off.
"""

import ctypes
import importlib
import io
import logging
import os
import runpy
import signal
import socket
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any, Optional

from megatron.bridge.utils import upstream

logger = logging.getLogger(__name__)

PRELOAD = ("megatron.bridge.models", "megatron.bridge.training.pretrain", "megatron.bridge.recipes.tiny_gpt")
"""What the standby imports: the model providers (torch and megatron-core behind them) and the training loop."""

OPT_OUT = "--no-preload-workers"
"""The launcher flag that starts every worker as a fresh interpreter instead."""

_PR_SET_CHILD_SUBREAPER = 36


# ----------------------------------------------------------------------------------------- launcher side


class ForkedWorker:
    """The launcher's handle on a worker forked by the standby (what torch elastic uses of ``subprocess.Popen``)."""

    def __init__(self, pid: int, args: tuple) -> None:
        self.pid = pid
        self.args = args
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        """The exit code (negative: killed by that signal) once the worker exited, else ``None``."""
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: gone, its code unknown
                self.returncode = 1
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        """Wait for the exit code; ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(list(self.args), timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """Signal the worker (unless it already exited)."""
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        """SIGTERM the worker."""
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL the worker."""
        self.send_signal(signal.SIGKILL)


def entry_request(args: tuple, env: dict[str, str], stdout: Optional[str], stderr: Optional[str]) -> Optional[dict]:
    """What a standby needs to run ``args`` (``python [-u] script|-m module ...``); ``None`` if it cannot."""
    if not args or os.path.realpath(str(args[0])) != os.path.realpath(sys.executable):
        return None
    rest = [str(a) for a in args[1:]]
    unbuffered = bool(rest) and rest[0] == "-u"
    rest = rest[1:] if unbuffered else rest
    if len(rest) >= 2 and rest[0] == "-m":
        module, script, argv = rest[1], None, rest[2:]
    elif rest and not rest[0].startswith("-"):
        module, script, argv = None, rest[0], rest[1:]
    else:
        return None
    return {
        "module": module, "script": script, "argv": argv, "unbuffered": unbuffered, "env": dict(env),
        "cwd": os.getcwd(), "stdout": stdout, "stderr": stderr,
    }  # fmt: skip


class Standby:
    """The launcher's standby process: started at the first worker start, then asked for every worker."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._conn: Optional[Connection] = None
        self._proc: Optional[subprocess.Popen] = None
        self._usable = sys.platform == "linux"

    def spawn(
        self, args: tuple, env: dict[str, str], stdout: Optional[str], stderr: Optional[str]
    ) -> Optional[ForkedWorker]:
        """A worker running ``args`` forked from the standby, or ``None`` (the caller starts it the usual way)."""
        request = entry_request(args, env, stdout, stderr)
        if request is None:
            return None
        with self._lock:
            if not self._usable or (self._conn is None and not self._start()):
                return None
            try:
                self._conn.send(request)
                status, value = self._conn.recv()
            except (OSError, EOFError) as err:
                self._give_up(f"the standby process is gone ({err})")
                return None
        if status != "ok":
            logger.warning("standby: could not fork a worker (%s); starting it the usual way", value)
            return None
        return ForkedWorker(value, args)

    def _start(self) -> bool:
        """Start the standby and wait until it imported :data:`PRELOAD`; ``False`` (and not again) if it cannot."""
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            return self._give_up(f"prctl(PR_SET_CHILD_SUBREAPER) failed: {os.strerror(ctypes.get_errno())}")
        mine, theirs = socket.socketpair()
        ours, fd = Connection(mine.detach()), theirs.detach()
        started = time.monotonic()
        self._proc = subprocess.Popen([sys.executable, "-m", __name__, str(fd)], pass_fds=(fd,))
        os.close(fd)
        try:
            status, value = ours.recv()
        except (OSError, EOFError):
            status, value = "failed", f"exited with code {self._proc.wait()}"
        if status != "ready":
            ours.close()
            return self._give_up(f"the standby process cannot serve: {value}")
        self._conn = ours
        logger.info(
            "standby: pid %d imported the workers' modules in %.1f s", self._proc.pid, time.monotonic() - started
        )
        return True

    def _give_up(self, why: str) -> bool:
        logger.warning("standby: %s; workers start as fresh interpreters", why)
        self._usable = False
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        return False


_STANDBY = Standby()


def popen_or_fork(original: Any) -> Any:
    """A ``SubprocessHandler._popen`` that forks the worker from the standby, else calls ``original``."""

    def _popen(handler: Any, args: tuple, env: dict[str, str]) -> Any:
        worker = _STANDBY.spawn(args, env, *upstream.worker_output_files(handler))
        return worker if worker is not None else original(handler, args, env)

    return _popen


def install(launcher: str, argv: list[str]) -> list[str]:
    """Make ``launcher`` fork its workers from the standby unless ``argv`` has :data:`OPT_OUT`.

    ``launcher`` is ``"torch"`` (torchrun) or ``"ft_launcher"``; returns ``argv`` without :data:`OPT_OUT`.
    """
    if OPT_OUT not in argv:
        key = upstream.STANDBY_PATCHES[launcher]
        original = upstream.find(key)
        if original is not None:
            upstream.patch(key, popen_or_fork(original))
    return [arg for arg in argv if arg != OPT_OUT]


# ----------------------------------------------------------------------------------------- standby side


def _serve(fd: int) -> Optional[dict]:
    """Import :data:`PRELOAD`, tell the launcher, then fork one worker per request until the launcher is gone.

    Returns only in a forked worker: its request.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's to handle; it closes the connection
    conn = Connection(fd)
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # device queries must not initialise CUDA before a fork
    for name in PRELOAD:
        importlib.import_module(name)
    import torch

    if torch.cuda.is_initialized():
        conn.send(("unsafe", "CUDA was initialised while importing"))
        return None
    conn.send(("ready", os.getpid()))
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return None
        read, write = os.pipe()
        middle = os.fork()
        if middle == 0:  # forks the worker and exits at once: the worker becomes the launcher's (subreaper) child
            os.close(read)
            me = os.getpid()
            worker = os.fork()
            if worker == 0:
                os.close(write)
                conn.close()
                while os.getppid() == me:  # start as the launcher's child, as a worker it started itself would
                    time.sleep(0.001)
                return request
            os.write(write, str(worker).encode())
            os._exit(0)
        os.close(write)
        with os.fdopen(read, "rb") as pipe:
            pid = pipe.read()
        os.waitpid(middle, 0)
        conn.send(("ok", int(pid)) if pid else ("failed", "the intermediate process died"))


def _become_worker(request: dict) -> None:
    """The launcher's session, signals, directory, environment, files and arguments; the thread count to match."""
    os.setsid()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        if path:
            target = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.dup2(target, fd)
            os.close(target)
    if request["unbuffered"]:  # ``python -u``
        for name, fd in (("stdout", 1), ("stderr", 2)):
            old = getattr(sys, name)
            raw = io.FileIO(fd, "w", closefd=False)
            setattr(sys, name, io.TextIOWrapper(raw, encoding=old.encoding, errors=old.errors, write_through=True))
    import torch

    wanted = request["env"].get("OMP_NUM_THREADS", "")  # OpenMP read it once, when the standby imported torch
    if wanted.isdigit() and int(wanted) > 0 and torch.get_num_threads() != int(wanted):
        torch.set_num_threads(int(wanted))
    if request["module"]:
        sys.argv = [request["module"], *request["argv"]]
        sys.path[0] = os.getcwd()
    else:
        sys.argv = [request["script"], *request["argv"]]
        sys.path[0] = os.path.dirname(os.path.abspath(request["script"]))


def main(fd: int) -> None:
    """The standby process; in each forked worker, run its entry point as ``__main__`` and exit like Python does."""
    request = _serve(fd)
    if request is None:
        return
    _become_worker(request)
    if request["module"]:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(request["script"], run_name="__main__")


if __name__ == "__main__":
    main(int(sys.argv[1]))
