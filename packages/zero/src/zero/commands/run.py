"""``zero run [options] script.py [script args]``: torchrun, with the script's arguments untouched.

torchrun's own parser matches option prefixes even after the script name (a script flag ``--d`` was taken as a
launcher flag, baselines.md). Here only the part before the script goes through torchrun's parser (with
abbreviations off); the script's arguments are handed to the launched processes as they are.

``zero run --as-deepspeed [torchrun options] script.py``: the ranks' ``import deepspeed`` is served by zero
(``zero.compat.alias``); refused while a real DeepSpeed is importable, unless ``--as-deepspeed-force``.

With DeepSpeed's launch flags (``--hostfile``, ``--num_nodes``, ``--num_gpus``, ``--include``/``--exclude``,
``--master_addr``/``--master_port``, ``--bind_cores_to_rank``, ``--launcher``) or ``--dry-run``, or under a
multi-node ``srun``, the launch is planned node by node (:mod:`zero.commands.launch_plan`) and each node's torchrun
agent is started by :mod:`zero.commands.node_runner`; otherwise torchrun runs in this process, as before.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import sys
import tempfile

from zero.commands.errors import UsageError
from zero.commands.launcher_args import launcher_parser as _launcher_parser
from zero.commands.launcher_args import split_argv


def add_arguments(parser) -> None:  # `zero run` bypasses argparse (see zero.cli.main); kept for the registry
    """No-op: ``zero run`` parses its launcher options with torchrun's own parser."""


ZERO_HELP = """zero's own options (anywhere before the script; DeepSpeed's launcher flags, planned node by node):
  --as-deepspeed, --as-deepspeed-force
                        serve the ranks' `import deepspeed` from zero (refused while DeepSpeed is importable,
                        unless -force)
  --autotuning tune|run  DeepSpeed's autotuning entry (= zero autotune)
  -H, --hostfile FILE   DeepSpeed hostfile: one "host slots=N" per line
  -i, --include SPEC    hosts/slots to use, e.g. "worker-0:0,2@worker-1"
  -e, --exclude SPEC    hosts/slots to leave out, same syntax
  --num_nodes N         first N hosts of the hostfile
  --num_gpus N          ranks per node (alias --num_accelerators)
  --master_addr HOST    rendezvous host (default: the first node); --master_port PORT (default 29500)
  --launcher ssh|pdsh|local
                        how each node's torchrun agent is started; --ssh_port PORT
  --bind_cores_to_rank  pin each rank to its share of the cores; --bind_core_list LIST
  --master_timeout S    seconds to wait for the rendezvous host (default 120)
  --dry-run             print each node's command and exit
Under a multi-node srun, SLURM_* variables are read. The options below are torchrun's.
"""


def print_help() -> None:
    """zero's own launcher options, then torchrun's (which ``zero run`` passes through)."""
    print(ZERO_HELP)
    _launcher_parser().print_help()


def validate_nproc(value: str) -> None:
    """torchrun accepts a positive integer or auto/cpu/gpu/xpu; anything else is a one-line error here."""
    if value in ("auto", "cpu", "gpu", "xpu"):
        return
    if not value.isdigit() or int(value) < 1:
        raise UsageError(f"--nproc-per-node must be a positive integer (or auto/cpu/gpu), got {value!r}")


def launch(launcher_argv: list[str], script_args: list[str]) -> None:
    """Run torchrun (``torch.distributed.run.run``) with ``launcher_argv`` and untouched ``script_args``.

    Raises: UsageError for bad launcher options; torch's ChildFailedError when a rank fails.
    """
    parser = _launcher_parser()
    try:
        args = parser.parse_args(launcher_argv)
    except SystemExit as e:
        raise UsageError(f"zero run: bad launcher options {launcher_argv[:-1]}") from e
    validate_nproc(str(args.nproc_per_node))
    args.training_script_args = list(script_args)
    from torch.distributed.run import run

    own_log_dir = None
    if args.log_dir is None:  # torchrun would make a /tmp/torchelastic_* folder of its own and leave it there
        own_log_dir = args.log_dir = tempfile.mkdtemp(prefix="zero-torchrun-")
    try:
        run(args)
    finally:
        if own_log_dir is not None:
            _remove_unless_it_holds_logs(own_log_dir)


def _remove_unless_it_holds_logs(folder: str) -> None:
    """Remove ``folder`` (torchrun's per-attempt, per-rank folders) unless a rank's log was written there
    (``--redirects``/``--tee`` without ``--log-dir``): then it stays for the user to read."""
    if any(f.is_file() for f in pathlib.Path(folder).rglob("*")):
        print(f"zero run: the ranks' logs are in {folder}", file=sys.stderr)
        return
    shutil.rmtree(folder, ignore_errors=True)


def main(argv: list[str]) -> int:
    """``zero run`` entry: returns 0, or 1 when a rank failed (torchrun's summary is printed)."""
    if argv in ([], ["-h"], ["--help"]):
        print_help()
        return 0 if argv else 2
    from zero.compat.alias import CLI_FLAGS, DeepSpeedPresentError, prepare_launch, split_cli_flags

    argv, as_deepspeed = split_cli_flags(argv)  # leading --as-deepspeed[-force]: serve `import deepspeed` from zero
    if argv and argv[0].split("=", 1)[0] != "--autotuning":  # the flags among the launcher options too
        launcher_argv, script_args = split_argv(argv, passthrough=tuple(CLI_FLAGS))
        launcher_argv, later = split_cli_flags(launcher_argv, anywhere=True)
        if later is not None:
            argv, as_deepspeed = launcher_argv + script_args, later or bool(as_deepspeed)
    if as_deepspeed is not None:
        try:
            prepare_launch(force=as_deepspeed)
        except DeepSpeedPresentError as e:
            print(f"zero run: {e}", file=sys.stderr)
            return 2

    if argv[0].split("=", 1)[0] == "--autotuning":  # DeepSpeed's `--autotuning tune|run` (zero autotune)
        from zero.commands.autotune import from_run

        return from_run(argv)
    launcher_argv, script_args = split_argv(argv)
    from zero.commands.launch_plan import extract_options

    opts = extract_options(launcher_argv[:-1])
    multi_node_srun = "SLURM_PROCID" in os.environ and int(os.environ.get("SLURM_NNODES", "1")) > 1
    if opts.given or multi_node_srun:
        from zero.commands.node_runner import launch_planned

        return launch_planned(opts, launcher_argv[-1:], script_args)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from zero.commands import faults

    try:
        launch(launcher_argv, script_args)
    except ChildFailedError as e:
        log_dir = faults.torchrun_log_dir(launcher_argv[:-1])
        print(f"zero run: {faults.from_child_failed(e, log_dir).message()}\n{e}", file=sys.stderr)
        return 1
    return 0
