"""SIGTERM as a preemption request, in a module that imports nothing heavy.

`slipstream train` installs the handler before it imports torch (seconds on a small machine),
so that a scheduler's SIGTERM at any point of start-up is a clean stop, not a kill.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from types import FrameType

logger = logging.getLogger(__name__)

POLL_S = 0.1
"""How often a wait looks for a SIGTERM that has arrived (the restart backoff, the launcher)."""


class Preempted(SystemExit):
    """A trainer received SIGTERM while it was being built and stopped before training: a
    SystemExit with status 0, the status of a preemption at a step boundary, so that uncaught it
    ends the process as the preemption asked and torchrun's agent does not restart it."""

    def __init__(self) -> None:
        super().__init__(0)


class PreemptionHandler:
    """Turns SIGTERM into a flag (`requested`) that the trainer polls between the stages of its
    construction and between steps; a second SIGTERM terminates at once. Installed only from the
    main thread (signals arrive there)."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)

    def uninstall(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def wait(self, timeout_s: float) -> None:
        """Sleep `timeout_s`, or less when SIGTERM arrives meanwhile (within `POLL_S`). Polled:
        the handler cannot wake a `threading.Event` safely, since it runs on the thread that
        would be waiting on it."""
        deadline = time.monotonic() + timeout_s
        while not self.requested and (left_s := deadline - time.monotonic()) > 0:
            time.sleep(min(left_s, POLL_S))

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested:
            self.uninstall()
            os.kill(os.getpid(), signal.SIGTERM)
            return
        logger.warning("SIGTERM: stopping at the end of this step, or of this stage of start-up, "
                       "then exiting")
        self.requested = True
