"""python -m cs336_systems.report --run RUN --results results/RUN --out report/RUN/writeup.md [--copy report/writeup.md]"""

from __future__ import annotations

import argparse
from pathlib import Path

from cs336_systems.report import relink, render


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--run", required=True)
    p.add_argument("--results", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True, help="the run's writeup (figures go beside it)")
    p.add_argument("--copy", type=Path, help="a second copy, with figure links relative to its own folder")
    args = p.parse_args()
    if not args.results.is_dir():
        p.error(f"--results {args.results}: no such directory")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    text = render(args.run, args.results, args.out.parent)
    args.out.write_text(text)
    if args.copy:
        prefix = Path(args.out.parent).relative_to(args.copy.parent).as_posix()
        args.copy.write_text(relink(text, prefix))


if __name__ == "__main__":
    main()
