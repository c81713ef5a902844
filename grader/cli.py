"""attnkit: the instructor's command line.

    attnkit stubs      write exercises/ from solutions/
    attnkit fixtures   regenerate fixtures/ from solutions/
    attnkit demo       grade the built-in sample submissions
"""
from __future__ import annotations

import argparse
import sys


def cmd_stubs(args):
    from .stubs import write_exercises

    for path in write_exercises():
        print(f"wrote {path}")


def cmd_fixtures(args):
    from .fixtures import generate

    manifest = generate(args.out) if args.out else generate()
    print(f"wrote {len(manifest['files'])} fixture files and manifest.json")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="attnkit", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("stubs", help="write exercises/ from solutions/").set_defaults(func=cmd_stubs)
    p = sub.add_parser("fixtures", help="regenerate fixtures/ from solutions/")
    p.add_argument("--out", help="write somewhere else than fixtures/")
    p.set_defaults(func=cmd_fixtures)
    args = parser.parse_args(argv)
    return args.func(args) or 0


if __name__ == "__main__":
    sys.exit(main())
