"""``zero plot RUN_LOG OUT.png``: seconds per step by phase (stacked areas) over the loss curve of a run log.

The run log is what ``zero train`` writes (``runs/<name>/log.jsonl``) or any JSON list / JSON Lines file in
zero_profiler's run-log schema (``step``, ``loss``, ``seconds``); drawing is zero_profiler's ``plot_run``.
"""

from __future__ import annotations

import os
import pathlib

from zero.commands.errors import UsageError


def add_arguments(parser) -> None:
    """RUN_LOG, OUT_PNG, --title, --dpi."""
    parser.add_argument("run_log", help="run log: JSON list or JSON Lines of {step, loss, seconds} records")
    parser.add_argument("out_png", help="PNG file to write (replaced atomically)")
    parser.add_argument("--title", default=None, help="figure title (default: the run log's name)")
    parser.add_argument("--dpi", type=int, default=100, help="resolution (default 100)")


def run(args) -> int:
    """Validate the inputs, draw with ``zero_profiler.plot_run`` into a temporary file, rename it into place.

    Raises UsageError (exit code 2, one line) for a missing or malformed log, an output not ending in ``.png``,
    a missing output folder or ``--dpi < 1``; nothing is written then.
    """
    log, out = pathlib.Path(args.run_log), pathlib.Path(args.out_png)
    if not log.is_file():
        raise UsageError(f"run log {str(log)!r} does not exist or is not a file")
    if out.suffix.lower() != ".png":
        raise UsageError(f"output {str(out)!r} must end in .png")
    if not out.parent.is_dir():
        raise UsageError(f"output folder {str(out.parent)!r} does not exist")
    if args.dpi < 1:
        raise UsageError(f"--dpi must be >= 1, got {args.dpi}")
    from zero_profiler import load_run_log, plot_run

    try:
        records = load_run_log(log)
    except (ValueError, OSError) as e:  # load_run_log names the record and the field
        raise UsageError(f"{log}: {e}") from None
    if not records:
        raise UsageError(f"run log {str(log)!r} has no records")
    tmp = out.with_name(f".{out.name}.tmp.png")
    try:
        plot_run([r.to_dict() for r in records], tmp, title=args.title or log.name, dpi=args.dpi)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    print(f"wrote {out} ({len(records)} steps)")
    return 0
