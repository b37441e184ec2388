"""An rlmega command leaves without the interpreter's teardown (rlmega/launch/process_exit.py), yet everything
a user can see still happens: its threads finish, atexit handlers run, buffered output is written, the code
is the command's. Each of these fails when its line in ``leave`` is taken out."""

import os
import subprocess
import sys
import textwrap


def test_leave_joins_threads_runs_atexit_flushes_and_skips_the_teardown(tmp_path):
    code = textwrap.dedent(f"""
        import atexit, pathlib, sys, threading, time
        from rlmega.launch.process_exit import leave
        out = pathlib.Path({str(tmp_path)!r})
        def late():
            time.sleep(0.3)
            (out / "thread").write_text("finished")
        threading.Thread(target=late).start()  # non-daemon: Python's exit waits for it
        atexit.register(lambda: (out / "atexit").write_text("ran"))
        class Teardown:
            def __del__(self):  # runs only when the interpreter tears its modules down
                (out / "teardown").write_text("ran")
        keep = Teardown()
        sys.stdout.write("no newline, still buffered")  # a pipe: block-buffered until flushed
        leave(3)
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # stdout a buffered pipe
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env
    )
    assert r.returncode == 3, r.stderr
    assert r.stdout == "no newline, still buffered"
    assert (tmp_path / "thread").read_text() == "finished"
    assert (tmp_path / "atexit").read_text() == "ran"
    assert not (tmp_path / "teardown").exists()  # the teardown was skipped: the time saved
