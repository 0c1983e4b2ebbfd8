"""kvray's own log lines inside Ray actors under `kvray -v`.

The CLI's -v sets KVRAY_VERBOSE=1, which the processes of an embedded Ray inherit. A Ray actor process
logs at WARNING by default, so the driver's and the workers' INFO lines (start-up times, the KV cache's
size, why CUDA graphs are off) never reached the user even with -v: each actor calls this first.
"""

from __future__ import annotations

import logging
import os

KVRAY_LOGGERS = ("actors", "kvcore")


def show_kvray_info_logs() -> None:
    """With KVRAY_VERBOSE=1, kvray's INFO lines in this process reach its stderr (the driver's console)."""
    if os.environ.get("KVRAY_VERBOSE") != "1":
        return
    root = logging.getLogger()
    if not root.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)
    for name in KVRAY_LOGGERS:
        logging.getLogger(name).setLevel(logging.INFO)
