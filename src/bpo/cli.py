"""The ``bpo`` command line. Each subcommand lives in the module that owns its concept and is
imported only when it runs, so ``bpo --help`` stays fast and a missing optional engine only
affects the commands that need it."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence

# name -> ("module:function", one-line help). The function takes argv (list[str]) and returns
# an exit code; it parses its own arguments (argparse with prog="bpo NAME").
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("bpo.train_cli:main", "train an agent with BPO (or a baseline) in a sandbox"),
    "compare": ("bpo.compare:main", "BPO vs GRPO, RLOO, GiGPO, PPO at matched compute"),
    "eval": ("bpo.evaluate:main", "evaluate a run or checkpoint on held-out tasks"),
    "verify": ("bpo.analysis.verify:main", "exact check of every estimator on tabular MDPs"),
    "init-model": ("bpo.policy.models:init_model_main", "build a tiny random-init chat model dir"),
    "fetch-model": (
        "bpo.policy.models:fetch_model_main",
        "install a pretrained model (smollm2-135m)",
    ),
    "check-sandbox": ("bpo.sandbox.check_cli:main", "check a sandbox against its contract"),
    "view": ("bpo.view:main", "write an HTML page of a run's sampled trees and curves"),
    "report": ("bpo.report:main", "(re)write a run's plots and report.md"),
    "tasks": (
        "bpo.tasks_cli:main",
        "generate task sets (code: SWE-style repair tasks from PyPI sdists)",
    ),
    "serve-shop": (
        "bpo.web.serve:main",
        "serve the local web shop (the web sandbox's site) for a person or an agent",
    ),
}


def _usage() -> str:
    width = max(len(n) for n in COMMANDS)
    lines = ["usage: bpo COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {n.ljust(width)}  {h}" for n, (_, h) in COMMANDS.items()]
    lines += ["", "Run 'bpo COMMAND --help' for a command's options."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0 if args else 2
    if args[0] in ("-V", "--version"):
        from bpo import __version__

        print(f"bpo {__version__}")
        return 0
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(
            f"bpo: unknown command {name!r}; valid commands: {', '.join(COMMANDS)}", file=sys.stderr
        )
        return 2
    target, _ = COMMANDS[name]
    module, func = target.split(":")
    return int(getattr(importlib.import_module(module), func)(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
