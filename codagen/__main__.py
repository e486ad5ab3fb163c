"""``python -m codagen <command>``: ``demo`` runs the main job."""
from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="codagen", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="run the demo")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from codagen.demo import main as demo
        return demo()
    return 2


if __name__ == "__main__":
    sys.exit(main())
