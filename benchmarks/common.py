"""Shared helpers of the benchmark scripts: machine facts, load average, latency summaries,
markdown tables and JSON output.

Every script prints a markdown table and, with ``--json PATH``, writes
``{"benchmark": ..., "command": ..., "machine": machine_info(), "rows": [...]}`` so that a
later run on another machine can be compared row by row.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

__all__ = [
    "Latency",
    "Stopwatch",
    "command_line",
    "fmt_bytes",
    "fmt_num",
    "load_average",
    "machine_info",
    "markdown_table",
    "write_json",
]


def load_average() -> tuple[float, float, float]:
    """The 1, 5 and 15 minute load averages (what ``uptime`` prints)."""
    one, five, fifteen = os.getloadavg()
    return round(one, 2), round(five, 2), round(fifteen, 2)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on: CPU, cores, memory, OS, Python, torch, GPU, date and
    load average (taken now: call it when the run starts and again when it ends)."""
    info: dict[str, Any] = {
        "date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
        "machine": platform.machine(),
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "load_average": load_average(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
    }
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        info["memory_gb"] = round(pages / 1e9, 1)
    except (ValueError, OSError):
        pass
    if "torch" in sys.modules:  # report torch only where the script uses it
        torch = sys.modules["torch"]
        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return info


def command_line() -> str:
    """The command that ran this script, as it could be typed again."""
    return " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0]), *sys.argv[1:]])


@dataclass(frozen=True)
class Latency:
    """Summary of repeated timings, in milliseconds."""

    n: int
    median_ms: float
    p90_ms: float
    min_ms: float
    max_ms: float

    @classmethod
    def of(cls, seconds: Sequence[float]) -> Latency:
        """Summarise timings given in seconds (NaN fields when there are none)."""
        if not seconds:
            nan = float("nan")
            return cls(0, nan, nan, nan, nan)
        ms = sorted(1e3 * s for s in seconds)
        # p90: nearest rank, so that it is one of the measured values
        p90 = ms[min(len(ms) - 1, math.ceil(0.9 * len(ms)) - 1)]
        return cls(len(ms), statistics.median(ms), p90, ms[0], ms[-1])


class Stopwatch:
    """Accumulates the wall time of the calls it wraps: ``with watch: ...`` adds one lap."""

    def __init__(self) -> None:
        self.laps: list[float] = []
        self._t0 = 0.0

    def __enter__(self) -> Stopwatch:
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.laps.append(time.perf_counter() - self._t0)

    @property
    def total(self) -> float:
        return sum(self.laps)


def fmt_num(x: float | int | None, digits: int = 3) -> str:
    """``digits`` significant digits, or all integer digits for larger numbers ("-" for None
    or NaN)."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if isinstance(x, int) or abs(x) >= 10 ** (digits - 1):
        return f"{x:,.0f}"
    return f"{x:.{digits}g}"


def fmt_bytes(n: float | None) -> str:
    """Bytes as B, KB or MB (decimal units)."""
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return "-"
    for unit, size in (("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def markdown_table(
    headers: Sequence[str], rows: Iterable[Sequence[Any]], right: Iterable[int] = ()
) -> str:
    """A markdown table; columns whose index is in ``right`` are right-aligned."""
    right = set(right)
    lines = ["| " + " | ".join(headers) + " |"]
    lines.append("| " + " | ".join("---:" if i in right else "---" for i in range(len(headers))))
    lines[-1] += " |"
    for row in rows:
        lines.append("| " + " | ".join(str(c) for c in row) + " |")
    return "\n".join(lines)


def write_json(
    path: str | os.PathLike[str], benchmark: str, rows: list[dict[str, Any]], **extra: Any
) -> None:
    """Write the rows with the command, the machine and ``extra`` fields to ``path``."""
    payload = {
        "benchmark": benchmark,
        "command": command_line(),
        "machine": machine_info(),
        **extra,
        "rows": rows,
    }
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=1, default=_jsonable) + "\n")


def _jsonable(x: Any) -> Any:
    if hasattr(x, "_asdict"):
        return x._asdict()
    if hasattr(x, "__dataclass_fields__"):
        return {k: getattr(x, k) for k in x.__dataclass_fields__}
    if hasattr(x, "tolist"):
        return x.tolist()
    return str(x)
