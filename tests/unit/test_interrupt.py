"""Ctrl-C handling's question "am I a build worker?" (runtime/common/interrupt.py), asked inside a
signal handler: it must answer at every instant of the process, including the one where
multiprocessing is half imported (a Ctrl-C there was an AttributeError traceback). The signals
themselves, sent to real commands: e2e/test_interrupts.py."""

from __future__ import annotations

import multiprocessing
import sys
import types

from titan.runtime.common.interrupt import _is_worker


def test_the_main_process_is_not_a_worker():
    assert multiprocessing.current_process().name == "MainProcess"
    assert _is_worker() is False


def test_a_multiprocessing_half_imported_means_no_worker_yet(monkeypatch):
    half = types.ModuleType("multiprocessing.process")  # its module body has not bound its names yet
    monkeypatch.setitem(sys.modules, "multiprocessing.process", half)
    assert _is_worker() is False
    monkeypatch.delitem(sys.modules, "multiprocessing.process")
    assert _is_worker() is False


def test_a_named_child_process_is_a_worker(monkeypatch):
    child = types.ModuleType("multiprocessing.process")
    child._current_process = types.SimpleNamespace(name="ForkServerProcess-1")
    monkeypatch.setitem(sys.modules, "multiprocessing.process", child)
    assert _is_worker() is True
