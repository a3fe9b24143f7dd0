"""Workers forked from the launcher's pre-imported standby behave like workers started as fresh interpreters.

A tiny entry script under ``python -m megatron.bridge.launch`` (torchrun) and ``python -m megatron.bridge.ft_launch``
(ft_launcher, whose workers start through its own copy of torch elastic before nvidia-resiliency-ext 0.6 and through
torch's from 0.6 on) reports what a worker can see (and, under ft_launch, that the port its
rank 0's store listens on was picked outside the kernel's ephemeral range: ft_launch's port fix holds): whether
megatron-core was already imported (forked) or not (a fresh interpreter), its name, arguments, environment, session
and parent; then rank 1 raises, which must fail the launch with its traceback (exit codes through the standby:
every drill that expects 18, 21 or a restart). The opt-out flag: tests/unit_tests/test_standby.py.
"""

import subprocess
import sys
import textwrap

import pytest
from tests.resources import free_port

SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import torch
    print(
        "REPORT", os.environ["RANK"], "megatron.core" in sys.modules, __name__, sys.argv[1:],
        os.getsid(0) == os.getpid(), os.getppid(), torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS"),
        os.environ["MASTER_PORT"], flush=True,
    )
    if os.environ["RANK"] == "0":
        open("rank0.done", "w").close()
    else:  # after rank 0 reported: the launcher stops the other workers when one fails
        while not os.path.exists("rank0.done"):
            time.sleep(0.05)
        raise RuntimeError("boom from the worker")
    """
)


LAUNCHERS = {
    "torchrun": lambda: ["megatron.bridge.launch", f"--master-port={free_port()}"],
    "ft_launcher": lambda: [
        "megatron.bridge.ft_launch", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        "--max-restarts=0",
    ],
}  # fmt: skip


def _launch(tmp_path, *args: str, launcher: str = "torchrun") -> tuple[subprocess.Popen, str, str, list[list[str]]]:
    script = tmp_path / "report.py"
    script.write_text(SCRIPT)
    module, *options = LAUNCHERS[launcher]()
    proc = subprocess.Popen(
        [sys.executable, "-m", module, "--nproc-per-node=2", *options, *args],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    out, err = proc.communicate(timeout=120)
    reports = sorted(line.split(" ", 1)[1].split(" ", 3) for line in out.splitlines() if line.startswith("REPORT "))
    return proc, out, err, reports


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_forked_workers_see_what_a_fresh_interpreter_sees_and_fail_the_same_way(tmp_path, launcher):
    proc, out, err, reports = _launch(tmp_path, "report.py", "ok", launcher=launcher)
    assert len(reports) == 2, out + err[-3000:]
    for rank, (got_rank, preloaded, name, rest) in enumerate(reports):
        assert (got_rank, preloaded, name) == (str(rank), "True", "__main__"), out
        argv, session, parent, threads, omp, port = rest.rsplit(" ", 5)
        # its own arguments, its own session (the launcher signals the group), the launcher as parent, torch's thread
        # count as OMP_NUM_THREADS set it
        assert (argv, session, parent, threads) == ("['ok']", "True", str(proc.pid), omp), out
        if launcher == "ft_launcher":  # ft_launch's port fix applies to the installed release's pick of the port
            low, high = (int(x) for x in open("/proc/sys/net/ipv4/ip_local_port_range").read().split())
            assert not low <= int(port) <= high, f"MASTER_PORT {port} is in the ephemeral range {low}-{high}"
    assert proc.returncode == 1 and "RuntimeError: boom from the worker" in err, err[-3000:]
