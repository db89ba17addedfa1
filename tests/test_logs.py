"""The process age the start-up events report."""

import subprocess
import sys
import time


def test_process_seconds_counts_from_the_process_start():
    code = "import time; time.sleep(0.3); from pyserve.logs import process_seconds; print(process_seconds())"
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    wall = time.perf_counter() - start
    assert 0.29 <= float(run.stdout) <= wall  # 10 ms ticks
