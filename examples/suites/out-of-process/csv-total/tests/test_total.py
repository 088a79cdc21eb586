"""Hidden tests in the subprocess style: the agent's program runs in a child interpreter and only
its output comes back, so nothing the agent wrote runs in this test's interpreter."""

import subprocess
import sys
from pathlib import Path

WORKSPACE = Path(__file__).resolve().parents[1]


def run(tmp_path, text, column):
    data = tmp_path / "data.csv"
    data.write_text(text)
    return subprocess.run(
        [sys.executable, "-I", str(WORKSPACE / "total.py"), str(data), column],
        capture_output=True,
        text=True,
        timeout=20,
        cwd=tmp_path,
    )


def test_sums_a_column(tmp_path):
    done = run(tmp_path, "name,price\na,1.25\nb,11.25\n", "price")
    assert (done.returncode, done.stdout) == (0, "12.50\n")


def test_picks_the_named_column(tmp_path):
    done = run(tmp_path, "x,y\n1,10\n2,20\n", "x")
    assert done.stdout == "3.00\n"


def test_missing_column_exits_2(tmp_path):
    done = run(tmp_path, "x\n1\n", "nope")
    assert done.returncode == 2 and "no column nope" in done.stderr
