"""From DeepSpeed-style launch flags to one torchrun command per node (c10d rendezvous); nothing is started here.

Flags (before the script, as ``deepspeed``'s): ``--hostfile``/``-H``, ``--include``/``-i``, ``--exclude``/``-e``,
``--num_nodes``, ``--num_gpus`` (slots per node; on CPU, processes per node), ``--master_addr``,
``--master_port``, ``--bind_cores_to_rank``, ``--bind_core_list``, ``--launcher ssh|pdsh|local``, ``--ssh_port``,
``--master_timeout`` (ours), ``--dry-run`` (ours); every other option before the script is torchrun's and is passed
on unchanged (``--max-restarts``, ``--monitor-interval``, ``--log-dir``...). Without a hostfile under ``srun``
(``SLURM_PROCID`` and ``SLURM_NNODES`` set) the node count, rendezvous id and master come from ``SLURM_*``.

Each node runs ``python -m torch.distributed.run --nnodes N --nproc-per-node <slots> --rdzv-backend c10d
--rdzv-endpoint <master>:<port> --rdzv-id <id> --rdzv-conf is_host=<0|1> ... script args``: torchrun's agent does
the rendezvous, ranks and restarts. Ranks are numbered node by node, local ranks 0..slots-1 within a node; the
order of the nodes is the c10d rendezvous's (torch sorts the agents by host name), not the hostfile's.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass, field

from zero.commands import hostfile as hf
from zero.commands.errors import UsageError

DEFAULT_MASTER_PORT = 29500  # torch.distributed's (and DeepSpeed's) default
LAUNCHERS = ("ssh", "pdsh", "local")

# DeepSpeed's flag -> (our attribute, takes a value); dashes and underscores both accepted.
DEEPSPEED_FLAGS = {"--hostfile": ("hostfile", True), "-H": ("hostfile", True), "--include": ("include", True),
          "-i": ("include", True), "--exclude": ("exclude", True), "-e": ("exclude", True),
          "--num_nodes": ("num_nodes", True), "--num_gpus": ("num_gpus", True),
          "--num_accelerators": ("num_gpus", True),
          "--master_addr": ("master_addr", True), "--master_port": ("master_port", True),
          "--bind_cores_to_rank": ("bind_cores", False), "--bind_core_list": ("bind_core_list", True),
          "--launcher": ("launcher", True), "--ssh_port": ("ssh_port", True),
          "--master_timeout": ("master_timeout", True), "--dry-run": ("dry_run", False),
          "--dry_run": ("dry_run", False)}  # fmt: skip
_NUMERIC = {"num_nodes": int, "num_gpus": int, "master_port": int, "ssh_port": int, "master_timeout": float}


@dataclass
class LaunchOptions:
    """The DeepSpeed-style flags of ``zero run`` (see the module docstring); ``torchrun`` holds the rest."""

    hostfile: str | None = None
    include: str = ""
    exclude: str = ""
    num_nodes: int = -1
    num_gpus: int = -1
    master_addr: str | None = None
    master_port: int = DEFAULT_MASTER_PORT
    bind_cores: bool = False
    bind_core_list: str | None = None
    launcher: str | None = None
    ssh_port: int | None = None
    master_timeout: float = 120.0
    dry_run: bool = False
    torchrun: list[str] = field(default_factory=list)
    given: set[str] = field(default_factory=set)


def flag_name(tok: str) -> str:
    """``--num-nodes=2`` -> ``--num_nodes``: the DeepSpeed flag a token names (either spelling)."""
    name = tok.split("=", 1)[0]
    if name.startswith("--") and name not in DEEPSPEED_FLAGS:
        name = "--" + name[2:].replace("-", "_")  # --num-nodes == --num_nodes
    return name


def extract_options(launcher_argv: list[str]) -> LaunchOptions:
    """Split ``launcher_argv`` (options before the script, script excluded) into our flags and torchrun's.

    Raises: UsageError naming a flag without its value or with a value of the wrong type.
    """
    opts, rest, i = LaunchOptions(), [], 0
    while i < len(launcher_argv):
        tok = launcher_argv[i]
        name = flag_name(tok)
        if name not in DEEPSPEED_FLAGS:
            rest.append(tok)
            i += 1
            continue
        attr, takes_value = DEEPSPEED_FLAGS[name]
        if not takes_value:
            value, i = True, i + 1
        elif "=" in tok:
            value, i = tok.split("=", 1)[1], i + 1
        elif i + 1 < len(launcher_argv):
            value, i = launcher_argv[i + 1], i + 2
        else:
            raise UsageError(f"zero run: {name} needs a value")
        kind = _NUMERIC.get(attr)
        if kind is not None:
            try:
                value = kind(value)
            except ValueError:
                raise UsageError(f"zero run: {name} must be a number, got {value!r}") from None
        setattr(opts, attr, value)
        opts.given.add(attr)
    opts.torchrun = rest
    return opts


@dataclass(frozen=True)
class NodeCommand:
    """One node's torchrun command. ``torchrun_args`` are torchrun's options and the script (or module),
    ``script_args`` the script's arguments; ``env`` is exported on that node; one rank per slot runs there;
    ``log_dir`` is torchrun's ``--log-dir`` there."""

    node: int
    host: str
    slots: tuple[int, ...]
    torchrun_args: tuple[str, ...]
    script_args: tuple[str, ...]
    env: dict
    log_dir: str

    @property
    def argv(self) -> list[str]:
        """The exact command: ``python -m torch.distributed.run`` (= ``torchrun``) with :attr:`torchrun_args`
        (options, then the script or module) and the script's arguments."""
        return [sys.executable, "-m", "torch.distributed.run", *self.torchrun_args, *self.script_args]

    def shell(self) -> str:
        """The command as one shell line, environment first (what ``--dry-run`` prints and ssh runs)."""
        exports = " ".join(f"{k}={shlex.quote(str(v))}" for k, v in sorted(self.env.items()))
        return (exports + " " if exports else "") + shlex.join(self.argv)


@dataclass(frozen=True)
class Plan:
    """Every node's command and how they are started (``launcher``: ssh, pdsh, local, or ``this-node`` when an
    outside scheduler such as srun started one ``zero run`` per node)."""

    nodes: tuple[NodeCommand, ...]
    launcher: str
    master_addr: str
    master_port: int
    rdzv_id: str
    this_node: int | None = None

    @property
    def world_size(self) -> int:
        return sum(len(n.slots) for n in self.nodes)


def slurm_hosts(nodelist: str) -> list[str]:
    """Expand a ``SLURM_JOB_NODELIST`` (``node[01-03,7],gpu5``) into host names, as ``scontrol show hostnames``."""
    hosts = []
    for m in re.finditer(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist):
        prefix, ranges = m.group(1), m.group(2)
        if not ranges:
            hosts.append(prefix)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            for n in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{n:0{len(lo)}d}")
    return hosts


def _resources(opts: LaunchOptions, nproc: str | None) -> tuple[dict[str, list[int]], str | None]:
    """``({host: slots}, this_node_host)``: from the hostfile, from SLURM_* under srun, else this machine."""
    env = os.environ
    if opts.hostfile:
        if nproc is not None:
            raise UsageError("zero run: --nproc-per-node does not go with --hostfile (slots per host come from the "
                             "hostfile; --num_gpus N limits them)")  # fmt: skip
        active = hf.filter_resources(hf.read_hostfile(opts.hostfile), opts.include, opts.exclude)
        return hf.limit_resources(active, opts.num_nodes, opts.num_gpus), None
    if "SLURM_PROCID" in env and "SLURM_NNODES" in env:
        hosts = slurm_hosts(env.get("SLURM_JOB_NODELIST", "")) or [f"slurm-node-{i}" for i in
                                                                    range(int(env["SLURM_NNODES"]))]  # fmt: skip
        per_node = opts.num_gpus if opts.num_gpus > 0 else int(nproc or env.get("SLURM_NTASKS_PER_NODE", "1"))
        pool = {h: list(range(per_node)) for h in hosts[: int(env["SLURM_NNODES"])]}
        return hf.limit_resources(pool, opts.num_nodes, -1), hosts[int(env.get("SLURM_NODEID", "0"))]
    if opts.include or opts.exclude:
        raise UsageError("zero run: --include/--exclude need a --hostfile to select from")
    if opts.num_nodes > 1:
        raise UsageError(f"zero run: --num_nodes {opts.num_nodes} needs a --hostfile listing that many hosts")
    per_node = opts.num_gpus if opts.num_gpus > 0 else int(nproc or 1)
    return {"localhost": list(range(per_node))}, None


def _torchrun_value(args: list[str], *names: str) -> str | None:
    """The value given to the first of ``names`` in ``args`` (``--x v`` or ``--x=v``), else None."""
    for i, tok in enumerate(args):
        key, eq, value = tok.partition("=")
        if key in names:
            return value if eq else (args[i + 1] if i + 1 < len(args) else None)
    return None


def user_log_dir(opts: LaunchOptions) -> str | None:
    """The ``--log-dir`` the user gave torchrun, else None (zero then chooses ``<tmp>/zero-run-<run id>``)."""
    return _torchrun_value(opts.torchrun, "--log-dir", "--log_dir")


_NO_VALUE = ("--standalone",)  # torchrun flags among those the plan sets itself that take no value


def _without(args: list[str], *names: str) -> list[str]:
    """``args`` less the options ``names`` (and their values), which the plan sets for every node."""
    out, skip = [], False
    for tok in args:
        if skip:
            skip = False
            continue
        key, eq, _ = tok.partition("=")
        if key in names:
            skip = not eq and key not in _NO_VALUE
            continue
        out.append(tok)
    return out


def build_plan(opts: LaunchOptions, script: list[str], script_args: list[str]) -> Plan:
    """Resolve hosts and slots and build each node's torchrun command.

    ``script``: the script path (or ``-m``'s module) as the user gave it, ``script_args`` its arguments.
    Raises: UsageError / HostfileError for a bad hostfile line, a filter naming an unknown host or slot,
    ``--num_nodes`` larger than the hostfile, an unknown ``--launcher`` or conflicting options.
    """
    if not 0 < opts.master_port < 65536:
        raise UsageError(f"zero run: --master_port must be in 1..65535, got {opts.master_port}")
    nproc = _torchrun_value(opts.torchrun, "--nproc-per-node", "--nproc_per_node")
    resources, this_host = _resources(opts, nproc)
    launcher = opts.launcher or ("this-node" if this_host else "local" if not opts.hostfile else None)
    hosts = list(resources)
    if launcher is None:
        local_only = all(h in ("localhost", "127.0.0.1") for h in hosts)
        launcher = "local" if local_only else ("pdsh" if _which("pdsh") else "ssh")
    if launcher not in LAUNCHERS + ("this-node",):
        raise UsageError(f"zero run: --launcher must be one of {', '.join(LAUNCHERS)}, got {launcher!r}")
    master = opts.master_addr or (os.environ.get("MASTER_ADDR") if this_host else None)
    if not master:
        master = "127.0.0.1" if launcher == "local" else hosts[0]
    rdzv_id = os.environ.get("SLURM_JOB_ID") if this_host else None
    rdzv_id = (
        _torchrun_value(opts.torchrun, "--rdzv-id", "--rdzv_id") or rdzv_id or f"zero-{os.getpid()}-{int(time.time())}"
    )
    given_log_dir = user_log_dir(opts)
    passthrough = _without(opts.torchrun, "--nproc-per-node", "--nproc_per_node", "--rdzv-id", "--rdzv_id",
                           "--log-dir", "--log_dir", "--nnodes", "--rdzv-endpoint", "--rdzv_endpoint",
                           "--rdzv-backend", "--rdzv_backend", "--node-rank", "--node_rank", "--standalone",
                           "--master-addr", "--master_addr", "--master-port", "--master_port")  # fmt: skip
    if opts.bind_cores and ("--no-python" in passthrough or "--no_python" in passthrough):
        raise UsageError("zero run: --bind_cores_to_rank runs a Python entry first; it cannot go with --no-python")
    env = _exports()
    log_root = given_log_dir or os.path.join(tempfile.gettempdir(), f"zero-run-{rdzv_id}")
    target = _target(script, passthrough, opts)
    passthrough = [t for t in passthrough if t not in ("-m", "--module")] if opts.bind_cores else passthrough
    nodes = []
    for k, host in enumerate(hosts):
        slots = tuple(resources[host])
        node_env = dict(env)
        if opts.hostfile:
            node_env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, slots))
        log_dir = os.path.join(log_root, f"node{k}")
        args = ["--nnodes", str(len(hosts)), "--nproc-per-node", str(len(slots)), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{_bracket(master)}:{opts.master_port}", "--rdzv-id", rdzv_id,
                "--rdzv-conf", f"is_host={int(k == 0)}", "--log-dir", log_dir, "--tee", "3",
                *passthrough, *target]  # fmt: skip
        nodes.append(NodeCommand(k, host, slots, tuple(args), tuple(script_args), node_env, log_dir))
    this_node = hosts.index(this_host) if this_host in hosts else None
    if this_host and this_node is None:
        raise UsageError(f"zero run: this node {this_host!r} is not among the first --num_nodes hosts")
    return Plan(tuple(nodes), launcher, master, opts.master_port, rdzv_id, this_node)


def _bracket(addr: str) -> str:
    return f"[{addr}]" if ":" in addr else addr


def _target(script: list[str], passthrough: list[str], opts: LaunchOptions) -> list[str]:
    """The script (or module) torchrun starts; behind ``zero.commands.pin_cores`` when binding cores."""
    if not opts.bind_cores:
        return list(script)
    pin = ["-m", "zero.commands.pin_cores"]
    if opts.bind_core_list:
        pin += ["--core-list", opts.bind_core_list]
    if "-m" in passthrough or "--module" in passthrough:
        pin += ["--module"]
    return pin + list(script)  # torchrun's parser would drop a "--" here


def _exports() -> dict[str, str]:
    """Environment for every node: variables DeepSpeed exports (PYTHON*, MLFLOW*, UCX*, MV2*, NCCL*), the current
    folder on PYTHONPATH, ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, then the ``.zero_env`` / ``.deepspeed_env``
    files (home folder, then current folder; later lines override)."""
    env = {k: v for k, v in os.environ.items() if k.startswith(("PYTHON", "MLFLOW", "UCX", "MV2", "NCCL"))}
    # A fresh store per rendezvous round for the ranks: with the agents' shared store, a rank restarted for a
    # membership change (restart count unchanged) once read a dead peer's address (gloo "connection refused").
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    cwd = os.path.abspath(".")
    env["PYTHONPATH"] = cwd + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    for path in hf.find_env_file():
        env.update(hf.read_env_file(path))
    return env


def _which(name: str) -> bool:
    import shutil

    return shutil.which(name) is not None


def describe(plan: Plan) -> str:
    """``--dry-run``'s output: per node, the hosts' ranks as a comment line, then the exact command."""
    lines = [f"# {len(plan.nodes)} node(s), world size {plan.world_size}, launcher {plan.launcher}, rendezvous "
             f"c10d at {plan.master_addr}:{plan.master_port} (id {plan.rdzv_id})"]  # fmt: skip
    for n in plan.nodes:
        lines.append(f"# node {n.node}: host {n.host}, slots {','.join(map(str, n.slots))} ({len(n.slots)} ranks)")
        lines.append(n.shell())
    return "\n".join(lines)
