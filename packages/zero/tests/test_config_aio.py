"""The `aio` section (NVMe offload's I/O engine): DeepSpeed's keys, the old thread_count name, bad values named."""

import pytest

from zero.config import ConfigError, load_config


def test_engine_config_aio_section():
    cfg = load_config({"train_batch_size": 1, "aio": {"block_size": 262144, "queue_depth": 4, "thread_count": 2}})
    s = cfg.aio.settings()
    assert (s.block_size, s.queue_depth, s.thread_count) == (262144, 4, 2)
    with pytest.raises(ConfigError, match="aio.block_size"):
        load_config({"train_batch_size": 1, "aio": {"block_size": 1000}})
    with pytest.raises(ConfigError, match="disagree"):
        load_config({"train_batch_size": 1, "aio": {"thread_count": 2, "intra_op_parallelism": 3}})
