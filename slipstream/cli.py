"""The `slipstream` command: thin subcommands over the packages."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence


def _init_model(args: argparse.Namespace) -> None:
    from slipstream.model.create import create_model_dir

    config = create_model_dir(
        args.preset, args.out_dir, seed=args.seed, dtype=args.dtype, overwrite=args.overwrite
    )
    from slipstream.perf.flops import num_params

    print(f"wrote {args.preset} ({num_params(config) / 1e6:.1f}M parameters, {args.dtype}) to {args.out_dir}")


def _perf_calibrate(args: argparse.Namespace) -> None:
    from slipstream.perf.hardware import calibrate

    calibration = calibrate(force=args.force)
    print(json.dumps(calibration.to_dict(), indent=2) if args.json else calibration.format())


def _demo(args: argparse.Namespace) -> None:
    from slipstream.demo import format_report, run_demo

    report = run_demo(args.workdir, preset=args.preset)
    print(format_report(report))
    print(json.dumps(report))


def _add(
    subparsers: argparse._SubParsersAction, name: str, handler: Callable, help: str
) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(name, help=help, description=help)
    parser.set_defaults(handler=handler)
    return parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slipstream", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    commands = parser.add_subparsers(dest="command", required=True)

    p = _add(commands, "init-model", _init_model,
             "write a randomly initialised Hugging Face model directory from a preset")
    p.add_argument("out_dir")
    p.add_argument("--preset", default="tiny", help="tiny, small, medium (see slipstream.model.presets)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT_DIR")

    p = _add(commands, "demo", _demo,
             "the main job on the embedded defaults: create a model, run it on the corpus, report")
    p.add_argument("--workdir", default="runs/demo")
    p.add_argument("--preset", default="tiny")

    perf = _add(commands, "perf", None, "performance tools")
    perf = perf.add_subparsers(dest="perf_command", required=True)
    p = _add(perf, "calibrate", _perf_calibrate,
             "measure this machine's matmul peak per dtype and GEMM path, and its memory bandwidth")
    p.add_argument("--json", action="store_true")
    p.add_argument("--force", action="store_true", help="measure again instead of using the cache")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        args.handler(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"slipstream {args.command}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
