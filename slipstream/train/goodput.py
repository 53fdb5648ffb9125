"""The goodput ledger's writer: rank 0 appends one JSON line per event (start, ready, step,
checkpoint, eval, rollback, end; the launcher's launch) to RUN_DIR/goodput.jsonl and flushes it,
so the log survives a kill at any point. `slipstream.perf.goodput` reads it and charges every
second of the run's wall time to productive training or to a named loss (the definition is there).
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any

from slipstream.perf.goodput import LEDGER_FILE


class GoodputLedger:
    """Appends events to the run's ledger (a no-op when not `enabled`, i.e. off rank 0).
    Thread-safe: the checkpoint thread records commits."""

    def __init__(self, run_dir: str | Path, *, enabled: bool) -> None:
        self.path = Path(run_dir) / LEDGER_FILE
        self.enabled = enabled
        self._lock = threading.Lock()
        self._file = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a")  # noqa: SIM115

    def record(self, event: str, *, t: float | None = None, **fields: Any) -> None:
        if self._file is None:
            return
        line = json.dumps({"event": event, "t": time.time() if t is None else t, **fields})
        with self._lock:
            self._file.write(line + "\n")
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def record_launch(run_dir: str | Path) -> None:
    """The launcher's start (`slipstream train --nproc/--max-restarts`), as its process started,
    so that its own start-up (importing torch, checking the job) and the time torchrun takes to
    start the workers are charged too."""
    ledger = GoodputLedger(run_dir, enabled=True)
    ledger.record("launch", t=process_start_time(), pid=os.getpid())
    ledger.close()


def process_start_time() -> float:
    """This process's start as wall-clock time (Linux: /proc, 10 ms resolution); now elsewhere."""
    try:
        stat = Path("/proc/self/stat").read_text()
        start_ticks = int(stat[stat.rindex(")") + 2:].split()[19])  # field 22: starttime
        age_s = time.clock_gettime(time.CLOCK_BOOTTIME) - start_ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - age_s
    except (OSError, ValueError, AttributeError):
        return time.time()
