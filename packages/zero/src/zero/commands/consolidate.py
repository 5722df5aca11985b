"""``zero consolidate CKPT_DIR OUT_DIR``: one full-precision state dict from a sharded checkpoint (no ranks needed)."""

from __future__ import annotations

import pathlib

from zero.commands.errors import UsageError


def add_arguments(parser) -> None:
    """CKPT_DIR, OUT_DIR, --tag, --format, --exclude-frozen-parameters, --max-shard-size."""
    parser.add_argument("ckpt_dir", help="checkpoint root (holds 'latest' and the tag folders)")
    parser.add_argument("out_dir", help="output folder (model.safetensors, config.json when known)")
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: the one in CKPT_DIR/latest)")
    parser.add_argument("--format", choices=["safetensors", "torch"], default="safetensors")
    parser.add_argument(
        "--exclude-frozen-parameters",
        action="store_true",
        help="omit frozen parameters outside the optimizer (always omitted when the checkpoint excluded them)",
    )
    parser.add_argument("--max-shard-size", default=None,
                        help="split the output into files of at most this size (e.g. 5GB) plus an index, as "
                        "transformers' save_pretrained (default: one file)")  # fmt: skip


def run(args) -> int:
    """Delegate to ``zero_core.checkpoint.consolidate``; print the written file."""
    root = pathlib.Path(args.ckpt_dir)
    if not root.is_dir():
        raise UsageError(f"checkpoint folder {str(root)!r} does not exist")
    from zero_core.checkpoint import CheckpointError, consolidate

    try:
        path = consolidate(root, args.out_dir, tag=args.tag, fmt=args.format,
                           exclude_frozen=args.exclude_frozen_parameters,
                           max_shard_size=args.max_shard_size)  # fmt: skip
    except (CheckpointError, FileNotFoundError, ValueError) as e:
        raise UsageError(str(e)) from None
    print(f"wrote {path}")
    return 0
