"""How long a Python process that imported torch takes to exit, with the interpreter's final
garbage collections (the default) against them skipped by `gc.freeze()` in an exit handler, as
`slipstream`'s commands and tensor-parallel workers do.

Each run starts `python -c "import MODULES; ..."`, which registers the handler (or not), writes
the time as its last statement, and ends; the exit time is from that timestamp to the parent's
`wait` returning (the same clock). The two sides take turns, --repeats runs each per module set;
medians and their ratio are printed. There is no hardware limit to compare with: this is the
interpreter freeing (or not walking) a few hundred thousand objects on one core. Last line: one
JSON object.

    python benchmarks/process_exit.py
    python benchmarks/process_exit.py --repeats 9
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

from common import machine, median, print_json

IMPORTS = {
    "torch": "torch",
    "trainer": "slipstream.train.trainer",
    "engine": "slipstream.serve.engine",
}
"""What a process imported: torch alone, a training worker's modules, a serving engine's."""

PROGRAM = """
import atexit, gc, sys, time
import {module}
if {freeze}:
    atexit.register(gc.freeze)
sys.stdout.write(repr(time.time()))
"""


def exit_seconds(module: str, freeze: bool) -> float:
    """Seconds from the child's last statement to its end, as the parent sees it."""
    child = subprocess.run([sys.executable, "-c", PROGRAM.format(module=module, freeze=freeze)],
                           capture_output=True, text=True, check=True)
    return time.time() - float(child.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    results = {}
    for name, module in IMPORTS.items():
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.repeats):
            for freeze in (False, True):
                times[freeze].append(exit_seconds(module, freeze))
        default, frozen = median(times[False]), median(times[True])
        results[name] = {"default_exit_s": default, "frozen_exit_s": frozen, "ratio": default / frozen}
        print(f"{name:8s} exit: default {default:.3f} s, frozen {frozen:.3f} s, {default / frozen:.1f}x "
              f"faster (medians of {args.repeats}; default runs {min(times[False]):.3f}-"
              f"{max(times[False]):.3f} s)", flush=True)
    print_json({"benchmark": "process_exit", "repeats": args.repeats, "machine": machine(), **results})


if __name__ == "__main__":
    main()
