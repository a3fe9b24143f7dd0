"""Workers forked from the launcher's pre-imported standby behave like workers started as fresh interpreters.

A tiny entry script under ``python -m megatron.bridge.launch`` (torchrun) reports what a worker can see: whether
megatron-core was already imported (forked) or not (a fresh interpreter), its name, arguments, environment, session
and parent. An uncaught exception and the opt-out flag are checked on the same script (exit codes through the
standby: every drill that expects 18, 21 or a restart).
"""

import subprocess
import sys
import textwrap

from tests.resources import free_port

from megatron.bridge.standby import OPT_OUT

SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch
    print(
        "REPORT", os.environ["RANK"], "megatron.core" in sys.modules, __name__, sys.argv[1:],
        os.getsid(0) == os.getpid(), os.getppid(), torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS"),
        flush=True,
    )
    if sys.argv[1] == "raise":
        raise RuntimeError("boom from the worker")
    """
)


def _launch(tmp_path, nproc: int, *args: str) -> tuple[subprocess.Popen, str, str, list[list[str]]]:
    script = tmp_path / "report.py"
    script.write_text(SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, "-m", "megatron.bridge.launch", f"--nproc-per-node={nproc}", f"--master-port={free_port()}",
         *args],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    out, err = proc.communicate(timeout=120)
    reports = sorted(line.split(" ", 1)[1].split(" ", 3) for line in out.splitlines() if line.startswith("REPORT "))
    return proc, out, err, reports


def test_forked_workers_see_what_a_fresh_interpreter_sees_and_exit_the_same_way(tmp_path):
    proc, out, err, reports = _launch(tmp_path, 2, "report.py", "ok")
    assert proc.returncode == 0, err[-3000:]
    assert len(reports) == 2, out + err[-3000:]
    for rank, (got_rank, preloaded, name, rest) in enumerate(reports):
        assert (got_rank, preloaded, name) == (str(rank), "True", "__main__"), out
        argv, session, parent, threads, omp = rest.rsplit(" ", 4)
        # its own arguments, its own session (the launcher signals the group), the launcher as parent, torch's thread
        # count as OMP_NUM_THREADS set it
        assert (argv, session, parent, threads) == ("['ok']", "True", str(proc.pid), omp), out

    proc, out, err, _ = _launch(tmp_path, 1, "report.py", "raise")
    assert proc.returncode == 1 and "RuntimeError: boom from the worker" in err, err[-3000:]


def test_the_opt_out_starts_fresh_interpreters(tmp_path):
    proc, out, err, reports = _launch(tmp_path, 1, OPT_OUT, "report.py", "ok")
    assert proc.returncode == 0, err[-3000:]
    assert [r[1] for r in reports] == ["False"], out + err[-3000:]
