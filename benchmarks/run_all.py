"""Run every benchmark in one go and write docs/benchmarks.md (the command, versions, CPU model, date, tables).

Usage (what `nox -s bench` runs): python benchmarks/run_all.py [--quick] [--only comm,adam,training]
Each section is a ratio against a peer measured in the same run; this machine is shared and noisy, so medians.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata as md
import platform
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

SECTIONS = {
    "comm": ("Collectives and ZeRO++ bytes on the wire (zero-comm)", "bench_comm"),
    "adam": ("Optimizer step (zero-kernels CPU Adam vs torch and DeepSpeed)", "bench_adam"),
    "training": ("Training step side by side (zero vs DeepSpeed vs FSDP2 vs DDP)", "bench_training"),
}


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "not installed"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", default=",".join(SECTIONS))
    ap.add_argument("--output", default=str(ROOT / "docs" / "benchmarks.md"))
    args = ap.parse_args()
    command = "python3 -m nox -s bench" + (" -- --quick" if args.quick else "")
    parts = [
        "# Benchmarks",
        "",
        f"Produced by `{command}` on {datetime.date.today().isoformat()}; CPU: {cpu_model()}, "
        f"{len(__import__('os').sched_getaffinity(0))} cores; torch {version('torch')}, "
        f"deepspeed {version('deepspeed')}, zero {version('zero')}. Medians; ratios are against a peer measured "
        "in the same run (this machine is shared and noisy: compare within a table, not across runs).",
        "",
    ]
    failed = []
    for key in args.only.split(","):
        title, module = SECTIONS[key]
        parts.append(f"## {title}\n")
        try:
            mod = __import__(module)
            parts.append(mod.main(["--quick"] if args.quick else []))
        except Exception:  # noqa: BLE001 - one failed section must not hide the others' figures
            failed.append(key)
            parts.append(f"FAILED:\n```\n{traceback.format_exc()[-2000:]}\n```")
        parts.append("")
    Path(args.output).write_text("\n".join(parts))
    print("\n".join(parts))
    if failed:
        print(f"bench: sections failed: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
