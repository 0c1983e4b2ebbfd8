"""The embedded local Ray's start-up settings that need no Ray to check (cluster/replicas/placement.py)."""

from __future__ import annotations

from cluster.replicas.placement import PRESTART_ENV, prestart_setting


def test_gpu_machine_starts_without_worker_prestart(monkeypatch):
    monkeypatch.delenv(PRESTART_ENV, raising=False)
    assert prestart_setting(has_gpus=True) == {"_system_config": {"prestart_worker_first_driver": False}}


def test_cpu_machine_keeps_rays_default(monkeypatch):
    monkeypatch.delenv(PRESTART_ENV, raising=False)
    assert prestart_setting(has_gpus=False) == {}


def test_rays_own_variable_decides_when_set(monkeypatch):
    # An operator's explicit RAY_prestart_worker_first_driver is never overridden.
    for value in ("0", "1"):
        monkeypatch.setenv(PRESTART_ENV, value)
        assert prestart_setting(has_gpus=True) == {}
