"""When this process started, as a Unix time: the launcher's and the goodput ledger's start of last resort."""

import os
import time

_IMPORTED_AT = time.time()


def process_start_time() -> float:
    """Unix time this process started: from ``/proc/self/stat``, else psutil, else when this module was imported."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as up:
            started_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])  # field 22: start after boot, in ticks
            uptime = float(up.read().split()[0])
        return time.time() - (uptime - started_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil

        return float(psutil.Process().create_time())
    except Exception:  # noqa: BLE001 - not installed or not permitted: the import time is the best left
        return _IMPORTED_AT
