"""The main job, `python -m rudnn`, runs its self-check and reports success."""
import os
import subprocess
import sys


def test_main_self_check():
    env = dict(os.environ)
    env.pop("RUDNN_CPU_BLOCK", None)  # the job runs with the default tiles
    done = subprocess.run([sys.executable, "-m", "rudnn", "--no-benchmark", "--device", "cpu"], capture_output=True,
                          text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "passed: the rule is at most 2" in done.stdout


def test_main_benchmark_table():
    from rudnn import benchmark

    results = benchmark.run([benchmark.Case(1, 2, 64, 16), benchmark.Case(1, 2, 64, 16, mask="float-grad")], "cpu",
                            repeats=2, progress=False)
    table = benchmark.table(results)
    assert table.count("| rudnn |") == 4  # two cases, forward and forward+backward
    assert all(r.seconds > 0 for r in results if r.impl == "rudnn")
    assert "torch math" in table and "torch flash" in table
