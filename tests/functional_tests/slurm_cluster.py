"""A real one-node Slurm cluster with accounting (munge, MariaDB, slurmdbd, slurmctld, slurmd) for drills.

Two test runs on one machine must each get a cluster of their own, so nothing is shared between clusters but the
installed programs and the node name: every cluster has its own ports (slurmctld, slurmd, slurmdbd, MariaDB, from
:func:`tests.resources.free_port`), its own munged (socket, key, pid, seed and log files; the daemons, clients and
jobs find it through ``AuthInfo=socket=...``, connections to slurmdbd through ``AccountingStoragePass``), its own
MariaDB data and temporary directories and socket, cluster name, state, spool, pid and log files. ``NodeName`` must
be the host name; two slurmd with that name coexist because each answers only its own controller, on its own port.

:func:`slurm_cluster` starts the daemons, waits until the node is idle, yields the environment jobs and clients need
(``SLURM_CONF``), and stops them in the order that does not leave ``slurmstepd`` retrying RPCs: jobs, slurmd,
slurmctld, slurmdbd, MariaDB, munged. Nothing outlives it: every daemon and every job process carries the cluster's
``SLURM_CONF`` in its environment, the stop ends by SIGKILLing whatever still carries it, and a reaper process does
the same if the test process dies without stopping the cluster (SIGKILL, a crash). The daemons are started without
the test tags of :mod:`tests.processes`, so the end of the test that happened to start a shared cluster does not
stop it.

Debian packages ``slurmctld slurmd slurm-client slurmdbd munge mariadb-server`` must be installed
(``scripts/setup_slurm.sh``); the tests that need a cluster are skipped with the reason when they are not, or when
not running as root.
"""

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from tests import processes
from tests.resources import free_port

REQUIRED = (
    "slurmctld",
    "slurmd",
    "slurmdbd",
    "sbatch",
    "sacct",
    "sacctmgr",
    "munged",
    "mungekey",
    "mariadbd",
    "mariadb-install-db",
)
DB_USER, DB_PASS, DB_NAME = "slurm", "slurm-drill", "slurm_acct_db"
REPO = Path(__file__).resolve().parents[2]


def missing() -> str | None:
    """Why a cluster cannot be started here, or ``None``."""
    if os.geteuid() != 0:
        return "the Slurm drill starts daemons as root"
    absent = [tool for tool in REQUIRED if shutil.which(tool) is None and not Path("/usr/sbin", tool).exists()]
    return f"not installed: {', '.join(absent)}" if absent else None


def _which(tool: str) -> str:
    return shutil.which(tool) or str(Path("/usr/sbin", tool))


def _wait(predicate, timeout: float, what: str, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    tail = log.read_text()[-3000:] if log is not None and log.exists() else ""
    raise RuntimeError(f"{what} did not happen within {timeout} s\n{tail}")


def _run(*cmd: str, env: dict | None = None, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=timeout)
    if check and done.returncode != 0:
        output = (done.stdout + done.stderr)[-4000:]
        raise RuntimeError(f"{' '.join(cmd)} exited with {done.returncode}:\n{output}")
    return done


def _kill_pidfile(path: Path, timeout: float = 20) -> None:
    """SIGTERM the daemon named by ``path`` and wait for it to exit; SIGKILL it after ``timeout`` seconds."""
    try:
        pid = int(path.read_text().split()[0])
        os.kill(pid, signal.SIGTERM)
    except (OSError, ValueError, IndexError):  # no pid file, or the daemon is gone
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and processes.alive(pid):
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def sweep(conf: str, sockets: str) -> list[int]:
    """SIGKILL every process of the cluster whose ``slurm.conf`` is ``conf`` (daemons, slurmstepd, jobs); remove
    its socket directory. Returns the PIDs killed."""
    killed = processes.kill_tagged("SLURM_CONF", conf)
    shutil.rmtree(sockets, ignore_errors=True)
    return killed


def _slurm_conf(root: Path, sockets: Path, name: str, host: str, ports: dict[str, int]) -> str:
    return f"""ClusterName={name}
SlurmctldHost={host}
SlurmctldPort={ports["slurmctld"]}
SlurmdPort={ports["slurmd"]}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=10,socket={sockets}/munge.sock
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost={host}
AccountingStoragePort={ports["slurmdbd"]}
AccountingStoragePass={sockets}/munge.sock
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
ReturnToService=2
KillWait=30
MinJobAge=600
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
MailProg=/bin/true
NodeName={host} CPUs={os.cpu_count()} RealMemory=8000 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP PriorityTier=1
PartitionName=high Nodes=ALL Default=NO MaxTime=INFINITE State=UP PriorityTier=10 PreemptMode=OFF
"""


def _slurmdbd_conf(root: Path, sockets: Path, host: str, ports: dict[str, int]) -> str:
    return f"""AuthType=auth/munge
AuthInfo=socket={sockets}/munge.sock
DbdHost={host}
DbdPort={ports["slurmdbd"]}
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={ports["mariadb"]}
StorageUser={DB_USER}
StoragePass={DB_PASS}
StorageLoc={DB_NAME}
PidFile={root}/slurmdbd.pid
LogFile={root}/slurmdbd.log
"""


def _start_reaper(conf: str, sockets: Path) -> subprocess.Popen:
    """A process that sweeps the cluster once this one exits, however it exits (it reads a pipe until EOF)."""
    return subprocess.Popen(
        [sys.executable, "-m", "tests.functional_tests.slurm_cluster", conf, str(sockets)],
        stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO,
        env=processes.untracked_env(), start_new_session=True,
    )  # fmt: skip


def _start_munged(sockets: Path, root: Path, env: dict) -> Path:
    """munged with its own key and socket; returns its pid file. The socket's directory must be reachable by all."""
    _run(_which("mungekey"), "--create", f"--keyfile={sockets / 'munge.key'}")
    pid = sockets / "munged.pid"
    _run(
        _which("munged"), f"--socket={sockets / 'munge.sock'}", f"--key-file={sockets / 'munge.key'}",
        f"--pid-file={pid}", f"--seed-file={root / 'munged.seed'}", f"--log-file={root / 'munged.log'}", env=env,
    )  # fmt: skip
    return pid


def _start_mariadb(sockets: Path, root: Path, port: int, env: dict) -> Path:
    """A MariaDB server on its own data directory, temporary directory (servers sharing one collide on the names of
    temporary tables), socket and TCP port (127.0.0.1), with slurmdbd's user."""
    db, sock, log, pid = root / "db", sockets / "mariadb.sock", root / "mariadb.log", root / "mariadb.pid"
    tmp = root / "dbtmp"
    tmp.mkdir(exist_ok=True)
    _run(
        _which("mariadb-install-db"), "--no-defaults", f"--datadir={db}", f"--tmpdir={tmp}", "--user=root",
        "--skip-test-db", "--auth-root-authentication-method=normal", env=env, timeout=120,
    )  # fmt: skip
    subprocess.Popen(
        [_which("mariadbd"), "--no-defaults", f"--datadir={db}", f"--tmpdir={tmp}", "--user=root", f"--port={port}",
         "--bind-address=127.0.0.1", f"--socket={sock}", f"--pid-file={pid}", f"--log-error={log}",
         "--skip-log-bin", "--innodb-buffer-pool-size=16M"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        env=env,
    )  # fmt: skip
    _wait(lambda: sock.exists() and pid.exists(), 120, "MariaDB start", log)
    sql = (
        f"CREATE USER '{DB_USER}'@'127.0.0.1' IDENTIFIED BY '{DB_PASS}'; "
        f"GRANT ALL ON {DB_NAME}.* TO '{DB_USER}'@'127.0.0.1'; FLUSH PRIVILEGES;"
    )
    _run("mariadb", "--no-defaults", f"--socket={sock}", "-uroot", "-e", sql, env=env)
    return pid


@contextlib.contextmanager
def slurm_cluster(root: Path) -> Iterator[dict[str, str]]:
    """Start a cluster under ``root``; yield the environment for ``sbatch``/``squeue``/nemo_run; stop it."""
    host = socket.gethostname()
    ports = {daemon: free_port() for daemon in ("slurmctld", "slurmd", "slurmdbd", "mariadb")}
    name = f"drill{ports['slurmctld']}"
    for sub in ("state", "spool", "db"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    # Unix sockets: a short path (they are limited to 107 bytes) that every user can reach (munged requires it).
    sockets = Path(tempfile.mkdtemp(prefix="mbridge-slurm-"))
    sockets.chmod(0o755)
    conf = str(root / "slurm.conf")
    env = {**processes.untracked_env(), "SLURM_CONF": conf}
    (root / "slurm.conf").write_text(_slurm_conf(root, sockets, name, host, ports))
    dbd_conf = root / "slurmdbd.conf"
    dbd_conf.write_text(_slurmdbd_conf(root, sockets, host, ports))
    dbd_conf.chmod(0o600)
    reaper = _start_reaper(conf, sockets)
    started: list[Path] = []
    try:
        started.append(_start_munged(sockets, root, env))
        started.append(_start_mariadb(sockets, root, ports["mariadb"], env))
        _run(_which("slurmdbd"), env=env)
        started.append(root / "slurmdbd.pid")
        _wait(lambda: _run("sacctmgr", "-n", "list", "cluster", env=env, check=False).returncode == 0, 60,
              "slurmdbd start", root / "slurmdbd.log")  # fmt: skip
        _run("sacctmgr", "-i", "add", "cluster", name, env=env, check=False)
        _run(_which("slurmctld"), "-i", env=env)
        started.append(root / "slurmctld.pid")
        _run(_which("slurmd"), env=env)
        started.append(root / "slurmd.pid")
        _wait(lambda: _run("sinfo", "-h", "-o", "%T", env=env, check=False).stdout.strip() == "idle", 60,
              "node idle", root / "slurmctld.log")  # fmt: skip
        yield env
    finally:
        try:
            with contextlib.suppress(RuntimeError, subprocess.TimeoutExpired):
                _run("scancel", "--full", "-u", "root", env=env, check=False)
                _wait(lambda: not _run("squeue", "-h", env=env, check=False).stdout.strip(), 60, "empty queue")
            for pidfile in reversed(started):
                _kill_pidfile(pidfile)
        finally:
            sweep(conf, str(sockets))
            reaper.stdin.close()
            reaper.wait(timeout=30)


if __name__ == "__main__":  # the reaper: python -m tests.functional_tests.slurm_cluster <slurm.conf> <sockets>
    sys.stdin.read()  # returns at EOF: the test process closed the pipe, or exited
    sweep(sys.argv[1], sys.argv[2])
