"""docs/OPERATORS.md lists every operator argument with its current default."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_operator_reference_is_current():
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "operator_reference.py"), "--check"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
