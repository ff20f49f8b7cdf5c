"""The benchmark runs (quiesce alone here; Mooncake when installed)."""

import subprocess
import sys


def test_bench_runs_and_counts_no_corruption():
    out = subprocess.run(
        [sys.executable, "-m", "quiesce.bench", "--impl", "quiesce,quiesce-local", "--iters", "20",
         "--block", "10", "--rounds", "2", "--big", str(4 << 20)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "== 4 KiB write" in out.stdout and "== 64 × 64 KiB batch" in out.stdout
    # The big write's section names the size it measured.
    assert "== 4 MiB write" in out.stdout and "64 MiB write" not in out.stdout, out.stdout
    assert "quiesce       corrupted 0/2" in out.stdout, out.stdout
    assert "quiesce-local corrupted 0/2" in out.stdout, out.stdout


def test_demo_runs_and_exits_zero():
    out = subprocess.run(
        [sys.executable, "-m", "quiesce.demo", "--rounds", "2", "--big", str(4 << 20)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "quiesce   corrupted: 0/2" in out.stdout, out.stdout


def test_bench_refuses_an_unknown_implementation_or_a_small_buffer():
    """A misspelt --impl ran Mooncake under that name; a --big under the
    batch case's 4 MiB failed inside it."""
    for args in (["--impl", "quiesce,Quiesce-local"], ["--impl", "quiesce", "--big", str(1 << 20)]):
        out = subprocess.run(
            [sys.executable, "-m", "quiesce.bench", *args],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 2, (args, out.stdout, out.stderr)
        assert "--" in out.stderr, out.stderr
