"""zero_comm.agreement: an error on one rank becomes the same error on every rank, never a hang."""

import pickle
import time

import pytest
import torch.distributed as dist

from zero_comm import AgreementTimeout, GroupOperationError, agree, same_outcome
from zero_comm.testing import run_ranks


class StateError(ValueError):
    """A module-level exception class: it can be rebuilt on every rank."""


def _one_rank_fails(bad: int, kind: str):
    rank = dist.get_rank()
    out = []
    for attempt in range(2):  # the group stays usable after a failed agreement
        try:
            with same_outcome("save_things"):
                if rank == bad and attempt == 0:
                    raise StateError("value 'args' of type Namespace cannot be stored") if kind == "typed" else \
                        RuntimeError("disk full")  # fmt: skip
            out.append("ok")
        except GroupOperationError as e:
            out.append((type(e).__name__, str(e), e.rank, e.operation, isinstance(e, StateError),
                        e.error_type, sorted(e.failures)))  # fmt: skip
    return out


@pytest.mark.parametrize("bad,kind", [(0, "typed"), (2, "typed"), (1, "plain")])
def test_error_on_one_rank_is_the_same_error_on_every_rank(bad, kind):
    results = run_ranks(_one_rank_fails, 3, bad, kind, timeout=60)
    first = results[0][0]
    for rank, (failed, then) in enumerate(results):
        assert failed == first, (rank, failed, first)  # the same type and message everywhere
        assert then == "ok"
    name, message, who, operation, typed, error_type, failing = first
    assert who == bad and operation == "save_things" and failing == [bad]
    assert f"save_things failed on rank {bad}: " in message
    if kind == "typed":
        assert typed and error_type.endswith("test_agreement.StateError") and name == "StateError"
        assert "'args' of type Namespace" in message
    else:
        assert not typed and error_type == "builtins.RuntimeError" and "disk full" in message


def _two_ranks_fail():
    rank = dist.get_rank()
    try:
        agree("load", FileNotFoundError(f"rank {rank}'s file is missing") if rank > 0 else None)
    except FileNotFoundError as e:  # the original class still catches it, on every rank
        return str(e), sorted(e.failures)
    return "no error"


def test_every_failing_rank_is_listed_and_the_lowest_is_named():
    results = run_ranks(_two_ranks_fail, 3, timeout=60)
    assert len(set(results[r][0] for r in range(3))) == 1
    message, failing = results[0]
    assert failing == [1, 2] and "failed on rank 1: builtins.FileNotFoundError: rank 1's file" in message
    assert "also failed on ranks [2]" in message


def _late_rank():
    if dist.get_rank() == 0:
        start = time.monotonic()
        try:
            agree("consolidate", None, timeout=0.5)
        except AgreementTimeout as e:
            return str(e), e.missing, time.monotonic() - start
        return "completed"
    time.sleep(2.5)  # never reaches the agreement while rank 0 waits
    return "late"


def test_a_rank_that_never_arrives_is_named_within_the_timeout():
    message, missing, waited = run_ranks(_late_rank, 2, timeout=60, pg_timeout=10)[0]
    assert missing == [1] and "ranks [1] did not arrive" in message and "consolidate" in message
    assert waited < 5


def test_without_a_process_group_the_local_error_is_raised_unchanged():
    assert not dist.is_initialized()
    with pytest.raises(KeyError):
        with same_outcome("x"):
            raise KeyError("k")
    agree("x")  # nothing to agree on


def _the_agreed_error_itself():
    try:
        agree("initialize", StateError("bad config value") if dist.get_rank() == 1 else None)
    except GroupOperationError as e:
        return e  # run_ranks pickles it to bring it back, as a multiprocessing pool or launcher would
    return None


def test_an_agreed_error_survives_pickling_with_its_type_and_message():
    results = run_ranks(_the_agreed_error_itself, 2, timeout=60)
    for err in results:  # unpickled here, in another process than the one that raised it
        assert isinstance(err, StateError) and isinstance(err, GroupOperationError)
        assert str(err) == str(results[0]) and "initialize failed on rank 1: " in str(err)
        assert "bad config value" in str(err) and err.failures == {1: results[0].failures[1]} and err.rank == 1
        again = pickle.loads(pickle.dumps(err))
        assert type(again) is type(err) and str(again) == str(err) and again.failures == err.failures
    timeout = pickle.loads(pickle.dumps(AgreementTimeout("save", 2.5, [1])))
    assert type(timeout) is AgreementTimeout and timeout.missing == [1] and "within 2.5 s" in str(timeout)
