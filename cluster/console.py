"""What `kvray` prints: quiet by default, detail with -v.

Quiet means kvray's own warnings and errors, the progress bar and the summary; not Ray's start-up
banners (the token-auth notice of an embedded Ray, "Started a local Ray instance"), not the INFO
chatter Ray's actors log (the compiled graph's teardown on every run), not the tracebacks of worker
actors that `kvray stress` kills on purpose. -v restores all of it.
"""
from __future__ import annotations

import logging
import os

# Ray loggers of the client process that only announce routine things.
_ROUTINE_RAY_LOGGERS = ("ray._private.authentication.authentication_token_setup", "ray._private.worker",
                        "ray._private.services", "ray.dag.compiled_dag_node")


def configure(verbose: bool) -> None:
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s" if verbose
                        else "kvray: %(message)s")
    logging.getLogger("kvray").setLevel(logging.INFO if verbose else logging.WARNING)
    if verbose:
        os.environ["KVRAY_VERBOSE"] = "1"  # the engine's actors (an embedded Ray inherits it) keep tracebacks
        return
    for name in _ROUTINE_RAY_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    # Processes of an embedded Ray inherit this: its actors log Ray's own messages at WARNING and up.
    os.environ.setdefault("RAY_LOGGER_LEVEL", "warning")
