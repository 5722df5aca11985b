#!/usr/bin/env python
"""zero_to_fp32.py: the full fp32 state dict of a checkpoint written by zero (a ZeRO implementation with
DeepSpeed's API), with the command line of DeepSpeed's script of this name.

``save_checkpoint`` copies this file into every checkpoint folder (as DeepSpeed does), so that::

    python zero_to_fp32.py CHECKPOINT_DIR OUTPUT_DIR [-t TAG] [--safe_serialization] [--max_shard_size 5GB]
                           [--exclude_frozen_parameters]

writes ``OUTPUT_DIR/pytorch_model.bin`` (``model.safetensors`` with ``--safe_serialization``; split into
``...-00001-of-0000N...`` files plus an index when larger than ``--max_shard_size``) and ``config.json`` for
transformers models. ``CHECKPOINT_DIR`` is the folder holding ``latest`` and the tag folders (this script's
folder). An ``OUTPUT`` ending in ``.bin``, ``.pt``, ``.pth`` or ``.safetensors`` names one file instead (DeepSpeed's
older ``output_file`` form; its suffix picks the format). Any world size and ZeRO stage converts directly.

It needs the ``zero-core`` package (installed with ``zero``); without it, it says so and exits with status 1.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

FILE_SUFFIXES = (".bin", ".pt", ".pth", ".safetensors")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """DeepSpeed 0.19.8's arguments: checkpoint_dir, output_dir, -t/--tag, --safe_serialization,
    --max_shard_size, --exclude_frozen_parameters, -d/--debug."""
    parser = argparse.ArgumentParser(prog="zero_to_fp32.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint_dir", help="the checkpoint folder (holds 'latest' and the tag folders)")
    parser.add_argument("output_dir", help="output folder, or one file ending in .bin/.pt/.pth/.safetensors")
    parser.add_argument(
        "--max_shard_size",
        default="5GB",
        help="largest weight file before the output is split, e.g. 5GB (1e9 bytes per GB)",
    )
    parser.add_argument(
        "--safe_serialization",
        action="store_true",
        help="write safetensors (model.safetensors) instead of torch.save (pytorch_model.bin)",
    )
    parser.add_argument(
        "-t",
        "--tag",
        default=None,
        help="checkpoint tag, e.g. global_step14 (default: the one named in CHECKPOINT_DIR/latest)",
    )
    parser.add_argument(
        "--exclude_frozen_parameters", action="store_true", help="leave out frozen parameters outside the optimizer"
    )
    parser.add_argument("-d", "--debug", action="store_true", help="show the full traceback of an error")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Convert; returns the exit status (0 written, 1 zero-core missing or the checkpoint unreadable)."""
    args = parse_args(argv)
    try:
        from zero_core.checkpoint import CheckpointError, consolidate
    except ImportError as e:
        print(f"zero_to_fp32.py: this checkpoint was written by zero and converting it needs the zero-core package "
              f"(installed with zero: pip install --find-links <zero's dist folder> 'zero>=0.2,<0.3'); "
              f"the import failed: {e}", file=sys.stderr)  # fmt: skip
        return 1
    out = args.output_dir
    as_file = out.endswith(FILE_SUFFIXES) and not os.path.isdir(out)
    try:
        if as_file:
            fmt = "safetensors" if out.endswith(".safetensors") else "torch"
            parent = os.path.dirname(os.path.abspath(out))
            os.makedirs(parent, exist_ok=True)
            tmp = tempfile.mkdtemp(prefix=".zero_to_fp32.", dir=parent)
            try:
                written = consolidate(args.checkpoint_dir, tmp, tag=args.tag, fmt=fmt,
                                      exclude_frozen=args.exclude_frozen_parameters)  # fmt: skip
                os.replace(written, out)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            written = out
        else:
            fmt = "safetensors" if args.safe_serialization else "torch"
            written = consolidate(args.checkpoint_dir, out, tag=args.tag, fmt=fmt,
                                  exclude_frozen=args.exclude_frozen_parameters,
                                  max_shard_size=args.max_shard_size)  # fmt: skip
    except (CheckpointError, FileNotFoundError, ValueError) as e:
        if args.debug:
            raise
        print(f"zero_to_fp32.py: {e}", file=sys.stderr)
        return 1
    print(f"wrote {written}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
