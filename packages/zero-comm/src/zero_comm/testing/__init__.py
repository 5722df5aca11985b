"""Multi-rank test harness: run a test body on N gloo ranks in spawned processes.

``run_ranks(fn, world_size, *args, timeout=...)`` runs ``fn(*args)`` on every rank with the default process
group initialised (gloo, a free port chosen by the OS through a TCPStore bound to port 0) and returns the list of
per-rank return values. The first exception is re-raised as :class:`RankFailure` carrying its rank and the remote
traceback. When the wall-clock bound expires, every unfinished rank's Python stacks are dumped (``faulthandler``)
and every rank is killed; :class:`RankTimeout` names the ranks that did not finish and where they were stuck.

Spawning a rank costs about 1.3 s of interpreter and torch start-up on the 2-core reference machine, which
dominates small tests, so workers are kept warm in one pool per world size and reused across calls; a pool whose
run failed or timed out is discarded (its processes may be stuck in a collective).

This mirrors the purpose of DeepSpeed's ``DistributedTest`` (warm per-world-size pools), with our own design.
"""

from zero_comm.testing.harness import RankFailure, RankTimeout, run_ranks, shutdown_pools

__all__ = ["RankFailure", "RankTimeout", "run_ranks", "shutdown_pools"]
