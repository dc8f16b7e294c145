"""The unit tier's rule holds by itself (tests/conftest.py): a test here that starts a process
fails, naming the tier it belongs in."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


def test_a_unit_test_cannot_start_a_process():
    with pytest.raises(AssertionError, match="starts a process: unit tests run in process; move it to tests/e2e"):
        subprocess.run([sys.executable, "-c", "pass"])
    with pytest.raises(AssertionError, match="move it to tests/e2e"):
        os.system("true")
