"""``bpo tasks generate FAMILY --out DIR``: (re)generate a shipped task set.

Families: ``code``, the SWE-bench-style repair tasks of :mod:`bpo.sandbox.envs.code_tasks`,
written to ``DIR/tasks.jsonl``. With the defaults the file equals the shipped
``code_data/tasks.jsonl`` byte for byte.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path


def _generate_code(args: argparse.Namespace) -> int:
    from bpo.sandbox.envs import code_generate, code_tasks

    projects = args.projects.split(",") if args.projects else None
    per_project = args.per_project or code_generate.PER_PROJECT
    t0 = time.monotonic()
    try:
        tasks = code_generate.generate(
            projects, per_project=per_project, jobs=args.jobs,
            data_dir=Path(args.data) if args.data else code_tasks.DATA_DIR,
        )  # fmt: skip
    except code_tasks.GenerationError as e:
        print(f"bpo tasks: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    code_tasks.save_tasks(tasks, out / "tasks.jsonl")
    kinds = Counter(t.mutation["kind"] for t in tasks)
    splits = Counter(t.split for t in tasks)
    print(
        f"wrote {len(tasks)} tasks to {out / 'tasks.jsonl'} in {time.monotonic() - t0:.0f} s; "
        f"kinds: {dict(sorted(kinds.items()))}; splits: {dict(sorted(splits.items()))}"
    )
    return 0


FAMILIES: dict[str, Callable[[argparse.Namespace], int]] = {"code": _generate_code}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bpo tasks", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    gen = sub.add_parser("generate", help="generate a task set")
    gen.add_argument("family", help=f"task family: {', '.join(FAMILIES)}")
    gen.add_argument("--out", required=True, help="directory to write tasks.jsonl into")
    gen.add_argument("--projects", help="comma-separated projects (default: all)")
    gen.add_argument(
        "--per-project", type=int, help="tasks per project (default: the shipped set's)"
    )
    gen.add_argument("--jobs", type=int, default=2, help="test runs at a time (default 2)")
    gen.add_argument("--data", help="directory of the vendored sdists (default: the shipped)")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.family not in FAMILIES:
        print(
            f"bpo tasks: unknown task family {args.family!r}; valid families: "
            f"{', '.join(FAMILIES)}",
            file=sys.stderr,
        )
        return 2
    return FAMILIES[args.family](args)


if __name__ == "__main__":
    sys.exit(main())
