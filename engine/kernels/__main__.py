"""`python -m engine.kernels build`: compile the CPU kernels now (scripts/setup runs this)."""

import logging
import sys

from .native import build_dir, status


def main(argv: list[str]) -> int:
    if argv != ["build"]:
        print("usage: python -m engine.kernels build", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    result = status()
    print(f"kernels: {'ready' if result.module else 'unavailable'} ({result.reason}) in {build_dir()}")
    return 0 if result.module else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
