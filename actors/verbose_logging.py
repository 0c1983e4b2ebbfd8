"""kvray's own log lines inside Ray actors under `kvray -v`.

The CLI's -v sets KVRAY_VERBOSE=1 in its own process. A Ray actor process logs at WARNING by default, so
the driver's and the workers' INFO lines (start-up times, the KV cache's size, why CUDA graphs are off)
never reached the user even with -v: each actor calls show_kvray_info_logs() first, and Ray streams its
stderr to the console (ray.init(log_to_driver=True)).

How the setting reaches the actors: the processes of an embedded Ray inherit the CLI's environment, but
those of a cluster started before (`ray start`, joined through RAY_ADDRESS or under `ray job submit`) do
not. So the driver actors are created with verbose_runtime_env(), and the worker actors each driver
creates inherit its runtime env (Ray merges env_vars into the job's own runtime env, working_dir kept).
"""

from __future__ import annotations

import logging
import os
from typing import Any

KVRAY_LOGGERS = ("actors", "kvcore")
VERBOSE_ENV = "KVRAY_VERBOSE"


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV) == "1"


def verbose_runtime_env() -> dict[str, Any] | None:
    """The runtime env that carries -v to the actors this process creates (None without -v: their
    default, and no runtime env of their own, which would keep them from reusing idle Ray workers)."""
    return {"env_vars": {VERBOSE_ENV: "1"}} if verbose() else None


def show_kvray_info_logs() -> None:
    """With KVRAY_VERBOSE=1, kvray's INFO lines in this process reach its stderr (the driver's console)."""
    if not verbose():
        return
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
    for name in KVRAY_LOGGERS:
        logging.getLogger(name).setLevel(logging.INFO)
