"""``bpo check-sandbox TARGET``: run :func:`~bpo.sandbox.check.check_sandbox` from the command
line on a registered environment (``toy``, ``--backend fork``, ``--option KEY=VALUE``) or on
any ``MODULE:FACTORY`` returning a Sandbox (tasks given with ``--task``); prints a report and
exits 1 on failure."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable, Sequence

import yaml

from bpo.sandbox.check import SandboxCheckError, check_sandbox
from bpo.sandbox.protocol import Sandbox


def _target(args: argparse.Namespace) -> tuple[Callable[[], Sandbox], list[str], str]:
    """(factory, tasks, label) for the command line's TARGET."""
    options = {}
    for item in args.option:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"bpo check-sandbox: --option wants KEY=VALUE, got {item!r}")
        options[key] = yaml.safe_load(value)
    if ":" in args.target:
        if args.backend != "auto" or options:
            raise SystemExit(
                "bpo check-sandbox: --backend/--option apply to registered "
                "environments; MODULE:FACTORY builds its own sandbox"
            )
        module, _, name = args.target.partition(":")
        try:
            factory = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:
            raise SystemExit(f"bpo check-sandbox: cannot load {args.target!r}: {e}") from None
        if not args.task:
            raise SystemExit("bpo check-sandbox: MODULE:FACTORY needs its tasks: --task NAME")
        return factory, list(args.task), args.target
    from bpo.sandbox import list_tasks, make_env

    tasks = list(args.task) or list_tasks(args.target, args.split, **options)[: args.tasks]
    return (lambda: make_env(args.target, args.backend, **options)), tasks, args.target


def main(argv: Sequence[str]) -> int:
    """``bpo check-sandbox TARGET``: check a sandbox's contract and print a report."""
    p = argparse.ArgumentParser(prog="bpo check-sandbox", description=main.__doc__)
    p.add_argument(
        "target",
        help="a registered environment name, or MODULE:FACTORY (a "
        "zero-argument callable returning a Sandbox)",
    )
    p.add_argument("--backend", default="auto", help="snapshot backend (registered envs)")
    p.add_argument("--tasks", type=int, default=2, help="number of tasks of the split")
    p.add_argument("--split", default="train", help="task split: train, valid or test")
    p.add_argument("--task", action="append", default=[], help="a task name (repeatable)")
    p.add_argument("--option", action="append", default=[], help="env option KEY=VALUE")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-steps", type=int, default=30)
    p.add_argument("--stress-nodes", type=int, default=40)
    p.add_argument("--rng-seed", type=int, default=0)
    args = p.parse_args(list(argv))
    factory, tasks, label = _target(args)
    print(f"checking {label} on {len(tasks)} task(s) ...", flush=True)
    try:
        report = check_sandbox(
            factory,
            tasks,
            seed=args.seed,
            max_steps=args.max_steps,
            stress_nodes=args.stress_nodes,
            rng_seed=args.rng_seed,
        )
    except SandboxCheckError as e:
        print(f"FAILED {e}")
        return 1
    print(report.render())
    print("PASSED")
    return 0
