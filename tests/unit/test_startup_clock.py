"""rlmega/rundir/startup.py: phases in seconds since the process started, printed, kept and written."""

import json
import subprocess
import sys
import time

from rlmega.rundir.startup import StartupClock, process_start_monotonic, read_setup


def test_phases_chain_or_overlap_print_and_reach_listeners_and_setup_json(tmp_path, capsys):
    clock = StartupClock(t0=time.monotonic() - 10.0)  # the process started 10 s ago
    seen = []
    clock.listeners.append(seen.append)
    clock.done("imports")
    began = clock.now()
    time.sleep(0.05)
    clock.done("engines", began)
    time.sleep(0.02)
    clock.done("first weight sync")
    imports, engines, sync = clock.phases
    assert imports["start_s"] == 0.0 and 10.0 <= imports["end_s"] < 11.0
    assert engines["start_s"] == round(began, 3) and engines["seconds"] >= 0.05
    assert sync["start_s"] == engines["end_s"]  # the next phase starts where the last one ended
    assert [len(s) for s in seen] == [1, 2, 3] and seen[-1] == clock.phases
    out = capsys.readouterr().out.splitlines()
    assert (
        len(out) == 3
        and out[1].startswith("rlmega: start-up ")
        and " engines 0.1 s (from 10." in out[1]
    )
    path = clock.write(tmp_path)
    assert (
        json.loads(path.read_text())
        == read_setup(tmp_path)
        == {"ready_s": sync["end_s"], "phases": clock.phases}
    )
    assert read_setup(tmp_path / "nothing") == {}


def test_time_zero_is_the_process_start_not_the_import():
    # a child that sleeps 1 s before it first reads the clock: its t = 0 is still its own start
    code = (
        "import time; time.sleep(1.0); from rlmega.rundir.startup import process_start_monotonic;"
        "print(time.monotonic() - process_start_monotonic())"
    )
    age = float(
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        ).stdout
    )
    assert 1.0 <= age < 10.0
    assert process_start_monotonic() <= time.monotonic()
