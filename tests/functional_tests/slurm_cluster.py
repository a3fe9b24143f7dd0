"""A real one-node Slurm cluster with accounting (munge, MariaDB, slurmdbd, slurmctld, slurmd) for drills.

Everything lives in a temporary directory; :func:`slurm_cluster` starts the daemons, waits until the node is idle,
yields the environment jobs and clients need (``SLURM_CONF``), and stops them in the order that does not leave
``slurmstepd`` retrying RPCs: jobs, slurmd, slurmctld, slurmdbd, MariaDB, munged. Debian packages
``slurmctld slurmd slurm-client slurmdbd munge mariadb-server`` must be installed (the CI script installs them);
the tests that need the cluster are skipped with the reason when they are not, or when not running as root.
"""

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

REQUIRED = (
    "slurmctld",
    "slurmd",
    "slurmdbd",
    "sbatch",
    "sacct",
    "sacctmgr",
    "munged",
    "mariadbd",
    "mariadb-install-db",
)
DB_USER, DB_PASS, DB_NAME = "slurm", "slurm-drill", "slurm_acct_db"


def missing() -> str | None:
    """Why a cluster cannot be started here, or ``None``."""
    if os.geteuid() != 0:
        return "the Slurm drill starts daemons as root"
    absent = [tool for tool in REQUIRED if shutil.which(tool) is None and not Path("/usr/sbin", tool).exists()]
    return f"not installed: {', '.join(absent)}" if absent else None


def _which(tool: str) -> str:
    return shutil.which(tool) or str(Path("/usr/sbin", tool))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(predicate, timeout: float, what: str, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    tail = log.read_text()[-3000:] if log is not None and log.exists() else ""
    raise RuntimeError(f"{what} did not happen within {timeout} s\n{tail}")


def _run(*cmd: str, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, capture_output=True, text=True, check=check, stdin=subprocess.DEVNULL)


def _kill_pidfile(path: Path, timeout: float = 20) -> None:
    if not path.exists():
        return
    try:
        pid = int(path.read_text().split()[0])
        os.kill(pid, signal.SIGTERM)
    except (ValueError, ProcessLookupError, IndexError):
        return
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def _slurm_conf(root: Path, host: str, dbd_port: int) -> str:
    return f"""ClusterName=drill
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=10
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost={host}
AccountingStoragePort={dbd_port}
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2,bf_interval=1
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


def _slurmdbd_conf(root: Path, host: str, dbd_port: int, db_port: int) -> str:
    return f"""AuthType=auth/munge
DbdHost={host}
DbdPort={dbd_port}
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={db_port}
StorageUser={DB_USER}
StoragePass={DB_PASS}
StorageLoc={DB_NAME}
PidFile={root}/slurmdbd.pid
LogFile={root}/slurmdbd.log
"""


@contextlib.contextmanager
def slurm_cluster(root: Path) -> Iterator[dict[str, str]]:
    """Start the cluster under ``root``; yield the environment for ``sbatch``/``squeue``/nemo_run; stop it."""
    host = socket.gethostname()
    for sub in ("state", "spool", "db"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    db_port, dbd_port = _free_port(), _free_port()
    env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}
    (root / "slurm.conf").write_text(_slurm_conf(root, host, dbd_port))
    dbd_conf = root / "slurmdbd.conf"
    dbd_conf.write_text(_slurmdbd_conf(root, host, dbd_port, db_port))
    dbd_conf.chmod(0o600)
    started: list[Path] = []
    try:
        # munge: the credentials every Slurm RPC carries
        Path("/run/munge").mkdir(parents=True, exist_ok=True)
        shutil.chown("/run/munge", "munge", "munge")
        munge_pid = Path("/run/munge") / f"munged-{os.getpid()}.pid"  # the munge user may not reach `root`
        _run("runuser", "-u", "munge", "--", _which("munged"), f"--pid-file={munge_pid}", "--force")
        started.append(munge_pid)
        # MariaDB for slurmdbd (TCP on 127.0.0.1 only)
        _run(
            _which("mariadb-install-db"),
            f"--datadir={root / 'db'}",
            "--user=root",
            "--auth-root-authentication-method=normal",
        )
        db_pid, db_sock, db_log = root / "mariadb.pid", root / "mariadb.sock", root / "mariadb.log"
        subprocess.Popen(
            [_which("mariadbd"), f"--datadir={root / 'db'}", "--user=root", f"--port={db_port}",
             "--bind-address=127.0.0.1", f"--socket={db_sock}", f"--pid-file={db_pid}", f"--log-error={db_log}"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        started.append(db_pid)
        _wait(db_sock.exists, 60, "MariaDB start", db_log)
        sql = (
            f"CREATE USER '{DB_USER}'@'127.0.0.1' IDENTIFIED BY '{DB_PASS}'; "
            f"GRANT ALL ON {DB_NAME}.* TO '{DB_USER}'@'127.0.0.1'; FLUSH PRIVILEGES;"
        )
        _run("mariadb", f"--socket={db_sock}", "-uroot", "-e", sql)
        # slurmdbd, then the cluster in the accounting database
        _run(_which("slurmdbd"), env=env)
        started.append(root / "slurmdbd.pid")
        _wait(lambda: _run("sacctmgr", "-n", "list", "cluster", env=env, check=False).returncode == 0, 60,
              "slurmdbd start", root / "slurmdbd.log")  # fmt: skip
        _run("sacctmgr", "-i", "add", "cluster", "drill", env=env, check=False)
        # controller and node
        _run(_which("slurmctld"), "-i", env=env)
        started.append(root / "slurmctld.pid")
        _run(_which("slurmd"), env=env)
        started.append(root / "slurmd.pid")
        _wait(lambda: _run("sinfo", "-h", "-o", "%T", env=env, check=False).stdout.strip() == "idle", 60,
              "node idle", root / "slurmctld.log")  # fmt: skip
        yield env
    finally:
        _run("scancel", "--full", "-u", "root", env=env, check=False)
        with contextlib.suppress(RuntimeError):
            _wait(lambda: not _run("squeue", "-h", env=env, check=False).stdout.strip(), 60, "empty queue")
        for pidfile in reversed(started):
            _kill_pidfile(pidfile)
