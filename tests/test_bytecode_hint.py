"""The start-up hint for packages without compiled bytecode (cluster/replicas/bytecode.py)."""

from __future__ import annotations

import compileall
import logging
import sys

import pytest

from cluster.replicas import bytecode


@pytest.fixture
def fake_pkg(tmp_path, monkeypatch):
    pkg = tmp_path / "kvray_fake_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return pkg


def test_reported_when_python_may_not_write_bytecode(fake_pkg, monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    assert bytecode.packages_without_bytecode(("kvray_fake_pkg",)) == ["kvray_fake_pkg"]


def test_not_reported_once_compiled(fake_pkg, monkeypatch):
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    assert compileall.compile_dir(str(fake_pkg), quiet=2)
    assert bytecode.packages_without_bytecode(("kvray_fake_pkg",)) == []


def test_not_reported_when_the_first_import_writes_it(fake_pkg, monkeypatch):
    # Python caches the bytecode at the first import: only the first process pays.
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    assert bytecode.packages_without_bytecode(("kvray_fake_pkg",)) == []


def test_missing_and_builtin_modules_are_skipped():
    assert bytecode.packages_without_bytecode(("kvray_no_such_package", "sys")) == []


def test_the_warning_names_the_package_and_the_fix_once(fake_pkg, monkeypatch, caplog):
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.setattr(bytecode, "PACKAGES", ("kvray_fake_pkg",))
    monkeypatch.setattr(bytecode, "warned", False)
    with caplog.at_level(logging.WARNING, logger="cluster.replicas.bytecode"):
        bytecode.warn_if_no_bytecode()
        bytecode.warn_if_no_bytecode()
    msgs = [r.getMessage() for r in caplog.records if r.name == "cluster.replicas.bytecode"]
    assert len(msgs) == 1
    assert "kvray_fake_pkg" in msgs[0] and "PYTHONDONTWRITEBYTECODE" in msgs[0]
    assert f"python -m compileall -q {fake_pkg}" in msgs[0]
