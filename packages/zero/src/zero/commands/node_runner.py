"""Start each node's torchrun agent (``local``: here; ``ssh``/``pdsh``: on its host), watch them, stop them together.

The first agent to exit non-zero is the failure: the others get ``GRACE_S`` seconds to fail on their own (their
ranks lose a peer, or the rendezvous store goes away with node 0), then SIGTERM, then SIGKILL ``KILL_AFTER_S``
seconds later. So after a rank dies with no restarts left, every node is down within torchrun's monitor interval
(0.1 s) + its worker shutdown + ``GRACE_S + KILL_AFTER_S`` seconds, and the message names the dead rank, its
signal or exit code and the last line of its log (:mod:`zero.commands.faults`).
"""

from __future__ import annotations

import collections
import errno
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

from zero.commands import faults
from zero.commands.errors import UsageError
from zero.commands.launch_plan import NodeCommand, Plan, user_log_dir

GRACE_S = 3.0
KILL_AFTER_S = 5.0
POLL_S = 0.1


class MasterUnreachable(UsageError):
    """The rendezvous endpoint (``--master_addr:--master_port``) cannot be hosted here or reached from here."""


def check_master_bindable(addr: str, port: int) -> None:
    """The local launcher hosts the rendezvous on ``addr:port``: fail now if this machine cannot bind there."""
    try:
        infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise MasterUnreachable(f"--master_addr {addr!r} does not resolve ({e.strerror})") from None
    family, _, _, _, sockaddr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind(sockaddr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise MasterUnreachable(f"--master_port {port} is in use on {addr}; choose another port") from None
            raise MasterUnreachable(f"--master_addr {addr!r} is not an address of this machine, so the local "
                                    f"launcher cannot host the rendezvous there ({e.strerror})") from None  # fmt: skip


def wait_reachable(addr: str, port: int, timeout_s: float, alive=lambda: True) -> float:
    """Connect to ``addr:port`` until it accepts (returns the seconds waited) or ``timeout_s`` passes.

    Raises: MasterUnreachable naming the endpoint, the time waited and the last connection error, also as soon as
    ``alive()`` turns False (the agent that was to host it exited).
    """
    start, last = time.monotonic(), "no attempt"
    while True:
        try:
            with socket.create_connection((addr, port), timeout=min(2.0, max(0.1, timeout_s))):
                return time.monotonic() - start
        except OSError as e:
            last = e.strerror or str(e)
        waited = time.monotonic() - start
        if waited >= timeout_s or not alive():
            raise MasterUnreachable(f"master {addr}:{port} unreachable after {waited:.1f} s ({last}); check "
                                    "--master_addr/--master_port and that node 0 is up (--master_timeout "
                                    "sets the wait)")  # fmt: skip
        time.sleep(0.2)


class _Agent:
    """One started node: its process, and the last lines it printed (to find torchrun's failure summary)."""

    def __init__(self, node: NodeCommand, argv: list[str], env: dict):
        self.node = node
        self.tail: collections.deque[str] = collections.deque(maxlen=400)
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     start_new_session=True, text=True, errors="replace", bufsize=1)  # fmt: skip
        self.reader = threading.Thread(target=self._relay, daemon=True)
        self.reader.start()

    def _relay(self) -> None:
        for line in self.proc.stdout:
            self.tail.append(line.rstrip("\n"))
            sys.stdout.write(line)
            sys.stdout.flush()

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass


def _command(plan: Plan, node: NodeCommand, ssh_port: int | None) -> tuple[list[str], dict]:
    env = {**os.environ, **node.env}
    if plan.launcher == "local":
        return node.argv, env
    remote = f"cd {shlex.quote(os.path.abspath('.'))} && {node.shell()}"
    if plan.launcher == "pdsh":  # one pdsh per host: the nodes' commands differ (is_host, slots)
        return ["pdsh", "-S", "-R", "ssh", "-w", node.host, remote], env
    port = ["-p", str(ssh_port)] if ssh_port else []
    # -tt: the remote agent gets SIGHUP (and stops its ranks) when this ssh is killed
    return ["ssh", "-tt", "-o", "BatchMode=yes", *port, node.host, remote], env


def run_plan(plan: Plan, ssh_port: int | None = None, master_timeout_s: float = 120.0) -> int:
    """Start every node of ``plan``, relay their output, wait; 0 when all succeed, else 1 after stopping all.

    Raises: MasterUnreachable (before anything is left running) when the rendezvous endpoint cannot be hosted or
    reached.
    """
    if plan.launcher == "local":
        check_master_bindable(plan.master_addr, plan.master_port)
    agents: list[_Agent] = []
    try:
        agents.append(_Agent(plan.nodes[0], *_command(plan, plan.nodes[0], ssh_port)))
        if len(plan.nodes) > 1:  # node 0 hosts the rendezvous: the others need it up
            first = agents[0].proc
            wait_reachable(plan.master_addr, plan.master_port, master_timeout_s, lambda: first.poll() is None)
        for node in plan.nodes[1:]:
            agents.append(_Agent(node, *_command(plan, node, ssh_port)))
        return _watch(agents)
    except BaseException:
        _stop(agents)
        raise


def _watch(agents: list[_Agent]) -> int:
    while True:
        codes = [a.proc.poll() for a in agents]
        failed = [a for a, c in zip(agents, codes) if c not in (None, 0)]
        if failed:
            t_fail = time.monotonic()
            _stop(agents, grace_s=GRACE_S)
            seconds = time.monotonic() - t_fail
            print(f"zero run: {_failure_text(agents)}; all {len(agents)} node(s) stopped {seconds:.1f} s after "
                  "the first failure was seen", file=sys.stderr, flush=True)  # fmt: skip
            return 1
        if all(c == 0 for c in codes):
            for a in agents:
                a.reader.join(timeout=5)
            return 0
        time.sleep(POLL_S)


def _failure_text(agents: list[_Agent]) -> str:
    """The dead rank, from every agent that failed: a rank killed by a signal is the cause (its peers then fail
    with collective errors, sometimes first), else the first failed node's root cause."""
    failed = [a for a in agents if a.proc.returncode not in (None, 0)]
    found = []
    for a in failed:
        a.reader.join(timeout=5)
        failure = faults.from_agent_output(list(a.tail), a.node.log_dir, a.node.node)
        if failure is not None:
            found.append(failure)
    if found:
        cause = next((f for f in found if f.exitcode < 0), found[0])
        others = [f"rank {f.rank} {f.how}" for f in found if f is not cause]
        return cause.message() + (f" (then: {', '.join(others)})" if others else "")
    agent = failed[0]
    last = next((ln for ln in reversed(agent.tail) if ln.strip()), "")
    return (f"node {agent.node.node} (host {agent.node.host}) exited with code {agent.proc.returncode}; "
            f"last line of its output: {last!r}")  # fmt: skip


def _stop(agents: list[_Agent], grace_s: float = 0.0) -> None:
    """Let the agents end on their own for ``grace_s``, then SIGTERM, then SIGKILL after ``KILL_AFTER_S``."""
    for sig, wait_s in ((None, grace_s), (signal.SIGTERM, KILL_AFTER_S), (signal.SIGKILL, KILL_AFTER_S)):
        if sig is not None:
            for a in agents:
                a.signal(sig)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and any(a.proc.poll() is None for a in agents):
            time.sleep(POLL_S)
        if all(a.proc.poll() is not None for a in agents):
            return


def launch_planned(opts, script: list[str], script_args: list[str]) -> int:
    """``zero run`` with DeepSpeed's launch flags: plan, then print (``--dry-run``), run this node's agent in this
    process (under srun: one ``zero run`` per node), or start every node's agent. Returns the exit code."""
    from zero.commands.launch_plan import build_plan, describe

    plan = build_plan(opts, script, script_args)
    if opts.dry_run:
        print(describe(plan))
        return 0
    try:
        if plan.launcher != "this-node":
            code = run_plan(plan, opts.ssh_port, opts.master_timeout)
        else:
            code = _run_this_node(plan, plan.nodes[plan.this_node], opts.master_timeout)
    except KeyboardInterrupt:  # the agents were stopped (SIGTERM, then SIGKILL)
        print("zero run: interrupted; every node stopped", file=sys.stderr)
        return 130
    if code == 0 and not user_log_dir(opts):
        _drop_logs(plan)
    return code


def _drop_logs(plan: Plan) -> None:
    """After a successful run, remove the ranks' log folders zero chose on this machine (DeepSpeed's launcher leaves
    none); a failed run keeps them, since its message points into them. Other machines' folders are theirs."""
    here = plan.nodes if plan.launcher == "local" else [plan.nodes[plan.this_node]] if plan.launcher == "this-node" \
        else []  # fmt: skip
    for node in here:
        shutil.rmtree(node.log_dir, ignore_errors=True)
    roots = {os.path.dirname(node.log_dir) for node in here}
    for root in roots:
        try:
            os.rmdir(root)  # only when empty: another node's agent on a shared /tmp may still write there
        except OSError:
            pass


def _run_this_node(plan: Plan, node: NodeCommand, master_timeout_s: float) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run

    from zero.commands.launcher_args import launcher_parser

    if node.node != 0:
        wait_reachable(plan.master_addr, plan.master_port, master_timeout_s)
    os.environ.update(node.env)
    args = launcher_parser().parse_args(list(node.torchrun_args))
    args.training_script_args = list(args.training_script_args) + list(node.script_args)
    try:
        run(args)
    except ChildFailedError as e:
        print(f"zero run: {faults.from_child_failed(e, node.log_dir, node.node).message()}", file=sys.stderr)
        return 1
    return 0
