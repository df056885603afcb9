"""``python -m runtime.server serve ...``: the server without the SDK's CLI."""

from __future__ import annotations

import argparse
import sys

from runtime.server.cli import register


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen subcommand; return its exit code."""
    parser = argparse.ArgumentParser(prog="python -m runtime.server")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
