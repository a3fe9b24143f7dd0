"""Workers forked from a pre-imported standby process, so that a (re)started rank does not import torch again.

The failure: torchrun and ``ft_launcher`` start every worker as a fresh interpreter, at the job's start and again at
every in-job restart. Before it can train, each one imports torch and megatron-core: 4 to 5 CPU-seconds per rank on
a small node, paid again by every rank after every fault (issue: restarts must not pay the whole import cost again).

What this does: when the launcher starts (torch imported, nothing else set up yet: no threads, signal handlers or
logging of its own), it forks one standby process that imports what every worker imports (:data:`PRELOAD`) while
the launcher goes on, and then waits. Each worker is forked from it, already imported, and runs its entry point
(``python -u script.py ...`` or ``python -u -m module ...``) with the environment, working directory, output files,
session, signal state and thread count the launcher gave it, as if it had been started with ``exec``, and leaves
the way ``python`` does (``SystemExit`` or an uncaught exception, then ``atexit``). The launcher waits on it,
signals its process group and reads its exit code as before: the standby double-forks and the launcher is made the
workers' child subreaper, so they are its children. Where the entry point is not the launcher's own Python, or
the standby cannot be used (not Linux, it died, CUDA got initialised in it), the worker is started the usual way:
never a failed start because of this module.

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
import traceback
from multiprocessing.connection import Connection
from typing import Any, Optional

from megatron.bridge.utils import upstream

logger = logging.getLogger(__name__)

PRELOAD = (
    "megatron.bridge.models",
    "megatron.bridge.training.pretrain",
    "megatron.bridge.recipes.tiny_gpt",
    "megatron.bridge.recipes.llama",
    "megatron.bridge.recipes.run",
    "megatron.bridge.data.builders",
    "torch._dynamo",
)
"""What the standby imports: the model providers (torch and megatron-core behind them), the training loop, the
recipes and the dataset builders, and what torch's optimizers import when the first one is built
(``torch._dynamo``, 0.5 s)."""

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
    """The launcher's standby process: forked when the launcher starts, then asked for every worker."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._conn: Optional[Connection] = None
        self._pid: Optional[int] = None
        self._started = 0.0
        self._ready = False

    def start(self) -> None:
        """Fork the standby (it imports :data:`PRELOAD` while the launcher goes on); once per launcher.

        In the forked processes this does not return: the standby exits when the launcher is gone, and a worker
        leaves through its entry point's exit (``SystemExit``, or its uncaught exception), as ``python`` would.
        """
        if self._pid is not None or sys.platform != "linux":
            return
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            logger.warning("standby: prctl(PR_SET_CHILD_SUBREAPER): %s", os.strerror(ctypes.get_errno()))
            return
        mine, theirs = socket.socketpair()
        sys.stdout.flush()
        sys.stderr.flush()
        self._started = time.monotonic()
        pid = os.fork()
        if pid == 0:
            mine.close()
            _standby(Connection(theirs.detach()))
        theirs.close()
        self._pid, self._conn = pid, Connection(mine.detach())

    def spawn(
        self, args: tuple, env: dict[str, str], stdout: Optional[str], stderr: Optional[str]
    ) -> Optional[ForkedWorker]:
        """A worker running ``args`` forked from the standby, or ``None`` (the caller starts it the usual way)."""
        request = entry_request(args, env, stdout, stderr)
        if request is None:
            return None
        with self._lock:
            if self._conn is None:
                return None
            try:
                if not self._ready:
                    status, value = self._conn.recv()
                    if status != "ready":
                        return self.stop(f"the standby process cannot serve: {value}")
                    self._ready = True
                    logger.info(
                        "standby: pid %d ready %.1f s after the launcher started it (imports: %.1f s)",
                        self._pid, time.monotonic() - self._started, value,
                    )  # fmt: skip
                self._conn.send(request)
                status, value = self._conn.recv()
            except (OSError, EOFError) as err:
                return self.stop(f"the standby process is gone ({err})")
        if status != "ok":
            logger.warning("standby: could not fork a worker (%s); starting it the usual way", value)
            return None
        return ForkedWorker(value, args)

    def stop(self, why: str) -> None:
        """Stop using the standby (it exits once the connection is closed); workers start the usual way."""
        logger.warning("standby: %s; workers start as fresh interpreters", why)
        if self._conn is not None:
            self._conn.close()
            self._conn = None


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
        _STANDBY.start()  # first: the launcher's module, imported to patch it, may set up logging
        key = upstream.applicable(upstream.STANDBY_PATCHES[launcher])
        original = upstream.find(key) if key is not None else None
        if original is not None:
            upstream.patch(key, popen_or_fork(original))
        else:  # nothing will ask it for workers: let it exit
            _STANDBY.stop(f"{key or launcher + ' worker start'} is gone")
    return [arg for arg in argv if arg != OPT_OUT]


# ----------------------------------------------------------------------------------------- standby side


def _standby(conn: Connection) -> None:
    """The standby process: exits, never returns; a forked worker runs its entry point and leaves as Python would.

    The worker leaves by raising ``SystemExit`` (or the entry point's exception) through the launcher's frames.
    """
    try:
        request = _serve(conn)
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    if request is None:
        os._exit(0)
    _become_worker(request)
    if request["module"]:
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(request["script"], run_name="__main__")
    raise SystemExit(0)


def _serve(conn: Connection) -> Optional[dict]:
    """Import :data:`PRELOAD`, tell the launcher, then fork one worker per request until the launcher is gone.

    Returns only in a forked worker: its request.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the launcher's to handle; it closes the connection
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # device queries must not initialise CUDA before a fork
    started = time.process_time()
    try:
        for name in PRELOAD:
            importlib.import_module(name)
    except Exception as err:  # the worker's own import will report it in full
        conn.send(("failed", f"importing {name}: {err!r}"))
        return None
    import torch

    if torch.cuda.is_initialized():
        conn.send(("unsafe", "CUDA was initialised while importing"))
        return None
    conn.send(("ready", time.process_time() - started))
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
            if os.fork() == 0:
                # Its own session (and process group) before the launcher learns its pid: from
                # nvidia-resiliency-ext 0.7 the launcher records each worker's group at once and kills the groups it
                # recorded at shutdown, which must never be the launcher's own.
                os.setsid()
                os.write(write, str(os.getpid()).encode())
                os.close(write)
                conn.close()
                while os.getppid() == me:  # start as the launcher's child, as a worker it started itself would
                    time.sleep(0.001)
                return request
            os._exit(0)
        os.close(write)
        with os.fdopen(read, "rb") as pipe:
            pid = pipe.read()
        os.waitpid(middle, 0)
        conn.send(("ok", int(pid)) if pid else ("failed", "the intermediate process died"))


def _become_worker(request: dict) -> None:
    """The launcher's signals, directory, environment, files and arguments; the thread count to match.

    The worker already has its own session, as a worker the launcher started itself would (``start_new_session``).
    """
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
