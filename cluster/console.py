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
_ROUTINE_RAY_LOGGERS = (
    "ray._private.authentication.authentication_token_setup",
    "ray._private.worker",
    "ray._private.services",
    "ray.dag.compiled_dag_node",
)
_QUIETED = "KVRAY_QUIETED_RAY"


def configure(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s" if verbose else "kvray: %(message)s",
    )
    logging.getLogger("kvray").setLevel(logging.INFO if verbose else logging.WARNING)
    for name in _ROUTINE_RAY_LOGGERS:
        logging.getLogger(name).setLevel(logging.NOTSET if verbose else logging.ERROR)
    if verbose:
        os.environ["KVRAY_VERBOSE"] = "1"  # the engine's actors (an embedded Ray inherits it) keep tracebacks
        # A quiet call earlier in this process (main() called twice) set the level below: take it back.
        if os.environ.pop(_QUIETED, None):
            os.environ.pop("RAY_LOGGER_LEVEL", None)
        return
    os.environ.pop("KVRAY_VERBOSE", None)
    # Processes of an embedded Ray inherit this: its actors log Ray's own messages at WARNING and up.
    if "RAY_LOGGER_LEVEL" not in os.environ:
        os.environ["RAY_LOGGER_LEVEL"] = "warning"
        os.environ[_QUIETED] = "1"  # kvray's setting, not the user's
