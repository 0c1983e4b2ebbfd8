"""Children that must take Ctrl-C as a terminal delivers it.

A pytest started in the background by a shell without job control (`nohup ... &`, a CI runner) inherits
SIGINT ignored, and so does every child it starts; Python then keeps it ignored, and a test's SIGINT is
lost (the child runs on, "not interrupted", until a timeout). Pass this as the child's preexec_fn.
"""

import signal


def sigint_as_in_a_terminal() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # Python installs its KeyboardInterrupt handler over it
