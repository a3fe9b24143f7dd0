import subprocess
import sys
import time

import pytest

from megatron.bridge.utils import process_start

pytestmark = pytest.mark.timeout(30)


def test_process_start_time_is_this_process_start():
    start = process_start.process_start_time()
    assert time.time() - 24 * 3600 < start <= time.time()
    assert start <= process_start._IMPORTED_AT + 1.0


def test_a_process_that_waited_before_the_import_reports_its_own_start():
    code = (
        "import time; before = time.time(); time.sleep(1.0); "
        "from megatron.bridge.utils.process_start import process_start_time; "
        "print(before - process_start_time())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=25, check=True)
    # Its start, to /proc's 10 ms ticks (the interpreter's start-up before ``before``: well under 10 s even on a busy
    # machine), not the import a second after ``before`` (which would give about -1).
    assert -0.05 < float(out.stdout) < 10
