"""The test sshd's guard against a pyenv rehash lock a killed login left behind
(tests/support/sshd.py): without it, every later login of the suite waits 60 s."""

from __future__ import annotations

import os
import threading
import time

from sshd import STALE_PYENV_LOCK_S, clear_stale_pyenv_lock


def plant(root, age_s: float):
    lock = root / "shims" / ".pyenv-shim"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.touch()
    made = time.time() - age_s
    os.utime(lock, (made, made))
    return lock


def test_a_lock_older_than_any_rehash_is_removed(tmp_path, monkeypatch):
    monkeypatch.setenv("PYENV_ROOT", str(tmp_path))
    lock = plant(tmp_path, STALE_PYENV_LOCK_S + 50)
    assert clear_stale_pyenv_lock() is True
    assert not lock.exists()


def test_a_lock_a_rehash_still_holds_is_left_to_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PYENV_ROOT", str(tmp_path))
    lock = plant(tmp_path, 0)
    # The rehash holding it ends after half a second and removes its own lock.
    threading.Timer(0.5, lock.unlink).start()
    started = time.monotonic()
    assert clear_stale_pyenv_lock() is False
    assert 0.4 < time.monotonic() - started < STALE_PYENV_LOCK_S


def test_no_lock_no_wait(tmp_path, monkeypatch):
    monkeypatch.setenv("PYENV_ROOT", str(tmp_path))
    started = time.monotonic()
    assert clear_stale_pyenv_lock() is False
    assert time.monotonic() - started < 1
