"""exit_without_final_collection: the exit code, and what finalization would have done that others can see."""

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import atexit, logging, sys, threading, time
    from megatron.bridge.utils.fast_exit import exit_without_final_collection

    out = sys.argv[1]
    logging.basicConfig(filename=out + ".log", level=logging.INFO)
    logging.getLogger("t").info("logged before exit")  # flushed by logging's atexit handler

    def late_writer():
        time.sleep(0.3)
        with open(out + ".thread", "w") as f:
            f.write("thread finished")

    threading.Thread(target=late_writer).start()  # not a daemon: the exit waits for it
    atexit.register(lambda: open(out + ".atexit", "w").write("handler ran"))
    atexit.register(lambda: 1 / 0)  # a failing handler does not stop the others
    sys.stdout.write("unflushed stdout")
    exit_without_final_collection(17)
    """
)


@pytest.mark.timeout(60)
def test_exit_code_threads_handlers_and_streams(tmp_path):
    out = tmp_path / "o"
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(out)], capture_output=True, text=True, timeout=50)
    assert proc.returncode == 17, proc.stderr
    assert proc.stdout == "unflushed stdout"
    assert "ZeroDivisionError" in proc.stderr
    assert (tmp_path / "o.thread").read_text() == "thread finished"
    assert (tmp_path / "o.atexit").read_text() == "handler ran"
    assert "logged before exit" in (tmp_path / "o.log").read_text()
