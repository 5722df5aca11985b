"""An error on one rank inside a collective operation is the same error on every rank, never a
hang; and ``client_state`` round-trips the values training scripts keep there, without unpickling on load.

Variants: save (a value that cannot be stored on rank 0, on rank 1; then a retry that succeeds), load (a rank that
cannot find the checkpoint), ``save_16bit_model`` (rank 0 cannot write), ``initialize`` (a config error on one
rank), ``zero_init`` (a module's ``__init__`` raising on one rank), ``GatheredParameters`` (the block raising on
the modifier rank); stages 2 and 3 for the checkpoint paths. Each run is bounded by the harness (a hang fails).
"""

import argparse
import dataclasses
import enum
import json
import os
import pathlib
import random
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from zero_comm.testing import run_ranks

sys.path.insert(0, str(pathlib.Path(__file__).parent))
from test_cases_faults import ADAMW_CFG, _batch, _engine, _net3  # noqa: E402


class Phase(enum.Enum):
    WARMUP = "warmup"
    MAIN = "main"


@dataclasses.dataclass
class RunInfo:
    name: str
    out_dir: pathlib.Path
    sizes: tuple[int, ...] = (1, 2)
    extra: dict = dataclasses.field(default_factory=dict)


def _one_step(eng):
    import torch.distributed as dist

    rank = dist.get_rank()
    x, y = _batch(0)
    eng.backward(F.cross_entropy(eng(x[rank * 4 : rank * 4 + 4]), y[rank * 4 : rank * 4 + 4]))
    eng.step()


def _client_state():
    """The case's client_state (Megatron-DeepSpeed's) plus the other types training scripts keep there."""
    torch.manual_seed(5)
    np.random.seed(5)
    random.seed(5)
    return {
        "iteration": 1,
        "args": argparse.Namespace(lr=0.1, train_iters=100, save="ckpt", betas=(0.9, 0.95)),
        "torch_rng_state": torch.get_rng_state(),
        "np_rng_state": np.random.get_state(),
        "random_rng_state": random.getstate(),
        "np_generator_state": np.random.default_rng(3).bit_generator.state,  # 128-bit integers inside
        "run": RunInfo("r1", pathlib.Path("/tmp/out"), (3, 4), {"phase": Phase.MAIN}),
        "phase": Phase.WARMUP,
        "best_loss": np.float64(1.25),
        "tokens": np.int64(12345),
        "mask": np.array([[True, False]]),
        "hist": np.array([0.5, float("nan")], dtype=np.float32),
        "nested": {"a": {"b": [1, (2, 3.5)], 7: "int key"}},
        "path": pathlib.PurePosixPath("data/train.bin"),
    }


def _same(a, b) -> bool:
    """Equal values of equal types, through containers (arrays and tensors compared exactly, NaN == NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b, equal_nan=a.dtype.kind == "f")
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, argparse.Namespace) or dataclasses.is_dataclass(a):
        return _same(vars(a), vars(b))
    return a == b


def _roundtrip_body(root: str, stage: int):
    eng = _engine(_net3(), stage, **ADAMW_CFG)
    _one_step(eng)
    eng.save_checkpoint(root, tag="t", client_state=_client_state())
    _, loaded = eng.load_checkpoint(root, tag="t")
    # compared here and returned as text: the loaded values include classes of this test module, which the
    # harness's pipe back to pytest would have to pickle by module name
    want = _client_state()
    wrong = [f"{k}: {loaded[k]!r} != {want[k]!r}" for k in want if k in loaded and not _same(loaded[k], want[k])]
    return wrong + [f"key {k!r} only on one side" for k in sorted(set(loaded) ^ set(want))]


@pytest.mark.parametrize("stage", [2, 3])
def test_client_state_round_trips_without_pickle(tmp_path, stage):
    for rank, wrong in enumerate(run_ranks(_roundtrip_body, 2, str(tmp_path), stage, timeout=120)):
        assert wrong == [], f"rank {rank}: {wrong}"
    # the types are named in the JSON; nothing in the checkpoint is a pickle
    meta = json.loads((tmp_path / "t" / "mp_rank_00_model_states.json").read_text())["client_state"]
    assert meta["args"]["__zero__"] == "namespace" and meta["run"]["type"].endswith("RunInfo")
    assert meta["phase"] == {"__zero__": "enum", "type": f"{Phase.__module__}.Phase", "name": "WARMUP"}
    for f in (tmp_path / "t").iterdir():
        assert not f.read_bytes().startswith(b"\x80"), f"{f.name} looks like a pickle"


def _unstorable_body(root: str, stage: int, bad_rank: int):
    import threading

    import torch.distributed as dist

    from zero_comm import GroupOperationError
    from zero_core.checkpoint.codec import UnsupportedStateError

    rank = dist.get_rank()
    eng = _engine(_net3(), stage, **ADAMW_CFG)
    _one_step(eng)
    state = {"iteration": 1, "lock": threading.Lock()} if rank == bad_rank else {"iteration": 1}
    try:
        eng.save_checkpoint(root, tag="t", client_state=state)
        failure = None
    except GroupOperationError as e:
        failure = (str(e), e.rank, isinstance(e, UnsupportedStateError))
    written = sorted(os.listdir(root)) if os.path.isdir(root) else []
    dist.barrier()
    eng.save_checkpoint(root, tag="t", client_state={"iteration": 1, "args": argparse.Namespace(lr=0.1)})  # retry
    _, loaded = eng.load_checkpoint(root, tag="t")
    return failure, written, loaded


@pytest.mark.parametrize("stage,bad_rank", [(2, 0), (2, 1), (3, 0)])
def test_unstorable_value_is_the_same_error_on_every_rank_and_nothing_is_written(tmp_path, stage, bad_rank):
    root = tmp_path / "ckpt"
    results = run_ranks(_unstorable_body, 2, str(root), stage, bad_rank, timeout=120)
    failures = [r[0] for r in results]
    assert failures[0] is not None and failures[0] == failures[1], failures
    message, who, typed = failures[0]
    assert who == bad_rank and typed
    assert f"save_checkpoint failed on rank {bad_rank}" in message and "client/lock" in message
    assert "_thread.lock" in message
    for _, written, loaded in results:
        assert written == []  # nothing written before the error
        assert loaded == {"iteration": 1, "args": argparse.Namespace(lr=0.1)}


def _load_missing_body(root: str):
    import torch.distributed as dist

    from zero_comm import GroupOperationError
    from zero_core.checkpoint import CheckpointError

    rank = dist.get_rank()
    eng = _engine(_net3(), 2, **ADAMW_CFG)
    eng.save_checkpoint(root, tag="t")
    where = root if rank == 0 else root + "-not-on-this-node"
    try:
        eng.load_checkpoint(where)
    except GroupOperationError as e:
        return str(e), e.rank, isinstance(e, CheckpointError)
    return None


def test_load_that_fails_on_one_rank_fails_on_every_rank(tmp_path):
    results = run_ranks(_load_missing_body, 2, str(tmp_path / "c"), timeout=120)
    assert results[0] is not None and results[0] == results[1]
    message, who, typed = results[0]
    assert who == 1 and typed and "load_checkpoint failed on rank 1" in message and "not-on-this-node" in message


def _save16_body(root: str):
    import torch.distributed as dist

    from zero_comm import GroupOperationError

    rank = dist.get_rank()
    zero_cfg = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_gather_16bit_weights_on_model_save": True}
    eng = _engine(_net3(), 3, zero_optimization=zero_cfg, **ADAMW_CFG)  # gathering on: rank 0 writes
    blocker = pathlib.Path(root) / "a-file"
    if rank == 0:
        blocker.parent.mkdir(parents=True, exist_ok=True)
        blocker.write_text("not a directory")
    dist.barrier()
    out = []
    for exclude in (False, True):
        try:
            eng.save_16bit_model(str(blocker), exclude_frozen_parameters=exclude)  # rank 0 cannot write there
            out.append(None)
        except GroupOperationError as e:
            out.append((e.operation, e.rank))
    return out


def test_save_16bit_model_write_failure_on_rank_0_reaches_every_rank(tmp_path):
    for out in run_ranks(_save16_body, 2, str(tmp_path), timeout=120):
        assert out == [("save_model_weights", 0), ("save_16bit_model", 0)]


def _initialize_body():
    import torch.distributed as dist

    from zero.config import ConfigError
    from zero_comm import GroupOperationError

    rank = dist.get_rank()
    zero_cfg = {"stage": 2, "reduce_bucket_size": 0 if rank == 1 else 1000}
    try:
        _engine(_net3(), 2, zero_optimization=zero_cfg, **ADAMW_CFG)
    except GroupOperationError as e:
        return str(e), e.rank, isinstance(e, ConfigError)
    return None


def test_initialize_config_error_on_one_rank_is_raised_on_every_rank():
    results = run_ranks(_initialize_body, 2, timeout=120)
    assert results[0] is not None and results[0] == results[1]
    message, who, typed = results[0]
    assert who == 1 and typed and "reduce_bucket_size" in message


class _FailsOnRank1(torch.nn.Module):
    def __init__(self):
        import torch.distributed as dist

        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        if dist.get_rank() == 1:
            raise RuntimeError("out of memory while building layer 3")


def _zero_init_body():
    import torch.distributed as dist

    from zero_comm import GroupOperationError
    from zero_core import GatheredParameters, zero_init

    out = []
    try:
        with zero_init():
            _FailsOnRank1()
        out.append(None)
    except GroupOperationError as e:
        out.append((e.operation, e.rank, str(e)))
    try:  # a write into a partitioned weight inside the context that fails on rank 1 only
        with zero_init(), torch.no_grad():
            lin = torch.nn.Linear(4, 4)
            lin.weight.copy_(torch.ones(4, 4) if dist.get_rank() == 0 else torch.ones(3))
        out.append(None)
    except GroupOperationError as e:
        out.append((e.operation, e.rank, "size" in str(e)))
    with zero_init():  # the group is still usable: a later construction partitions normally
        model = torch.nn.Linear(4, 4)
    try:
        with GatheredParameters(list(model.parameters()), modifier_rank=0):
            if dist.get_rank() == 0:
                raise ValueError("bad init value")
        out.append(None)
    except GroupOperationError as e:
        out.append((e.operation, e.rank, isinstance(e, ValueError)))
    with GatheredParameters([model.weight]):
        out.append(tuple(model.weight.shape))
    return out


def test_zero_init_and_gathered_parameters_failure_on_one_rank_reaches_every_rank():
    results = run_ranks(_zero_init_body, 2, timeout=120)
    assert results[0] == results[1]
    init_failure, write_failure, gathered_failure, shape = results[0]
    assert init_failure[:2] == ("zero_init", 1) and "out of memory while building layer 3" in init_failure[2]
    assert write_failure == ("zero_init", 1, True)
    assert gathered_failure == ("GatheredParameters", 0, True)
    assert shape == (4, 4)
