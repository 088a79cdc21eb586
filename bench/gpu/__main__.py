"""The GPU check's command line: ``python -m bench.gpu --help``."""

from __future__ import annotations

import argparse
import sys

from bench.gpu import __doc__ as overview
from bench.gpu.check import DEFAULT_OUT, main
from bench.gpu.plan import SECTIONS


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.gpu",
        description=overview.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", default=DEFAULT_OUT, help="the JSON file, rewritten after every step")
    parser.add_argument("--copy-to", default=None, help="a folder that also gets gpu.json after every step")
    parser.add_argument("--budget", type=float, default=420.0, help="seconds for all sections together")
    parser.add_argument("--quick", action="store_true", help="fewer presets and sizes")
    parser.add_argument("--models-dir", default=None, help="where built model folders are kept (and reused)")
    parser.add_argument(
        "--sections", default=None, help=f"comma-separated subset of {','.join(SECTIONS)} (a rerun of some)"
    )
    args = parser.parse_args(argv)
    sections = args.sections.split(",") if args.sections else None
    main(args.out, args.budget, args.quick, args.models_dir, sections, copy_to=args.copy_to)
    return 0


if __name__ == "__main__":
    sys.exit(cli())
