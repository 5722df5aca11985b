"""zero.activation_checkpointing's DeepSpeed options equal plain recomputation bit for bit in fp32.

Every option (partition_activations over a 2-rank model-parallel group holding the same activation, cpu_checkpointing,
contiguous_memory_optimization with number_checkpoints, synchronize, profile) is compared with
``torch.utils.checkpoint`` (zero's plain recomputation) on the same rank: losses and every gradient ``torch.equal``.
The blocks use dropout, so the recompute must replay the RNG. Also through the engine at ZeRO stages 0 and 3 (the
recompute re-gathers stage-3 parameters), and the errors DeepSpeed gives for inconsistent options.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import zero
import zero.activation_checkpointing.api as ckpt
from zero_comm.testing import run_ranks

WIDTH, LAYERS = 37, 4  # 37 x 3 rows = 111 elements: not divisible by 2 ranks, the last slice is padded


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.GELU(), torch.nn.Dropout(0.1))
            for _ in range(LAYERS)
        )
        self.head = torch.nn.Linear(WIDTH, 1)

    def forward(self, x):
        for block in self.blocks:
            x = ckpt.checkpoint(block, x)
        return self.head(x)


class MPU:
    """Megatron's mpu surface: the model-parallel group is every rank here (same activation on each)."""

    def get_model_parallel_group(self):
        return dist.group.WORLD


def _grads(model, x):
    torch.manual_seed(123)  # dropout masks
    loss = F.mse_loss(model(x), torch.ones(x.shape[0], 1))
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


OPTIONS = {
    "cpu": dict(checkpoint_in_cpu=True),
    "partition": dict(partition_activations=True),
    "partition+contiguous+cpu": dict(partition_activations=True, contiguous_checkpointing=True, num_checkpoints=4,
                                     checkpoint_in_cpu=True),
    "all+sync+profile": dict(partition_activations=True, contiguous_checkpointing=True, num_checkpoints=4,
                             synchronize=True, profile=True),
}  # fmt: skip


def _options_body():
    x = torch.randn(3, WIDTH, generator=torch.Generator().manual_seed(9), requires_grad=True)
    ckpt.configure(None)  # plain recomputation
    ref_loss, ref_grads = _grads(Net(), x)
    out = {}
    for name, kw in OPTIONS.items():
        ckpt.configure(MPU(), **kw)
        loss, grads = _grads(Net(), x)
        same = torch.equal(loss, ref_loss) and all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
        kept = [v.numel() for v in ckpt.settings.buffers.values()]
        out[name] = (same, kept, len(ckpt.timings()))
    return out


def test_every_option_equals_plain_recompute_bitwise():
    for rank, res in enumerate(run_ranks(_options_body, 2, timeout=120)):
        for name, (same, _, _) in res.items():
            assert same, f"rank {rank} {name}: loss or gradients differ from plain recomputation"
        # contiguous: one buffer of 4 slots x 56 elements (ceil(111 / 2)) per argument position: half the input
        assert res["partition+contiguous+cpu"][1] == [4 * 56], res
        assert res["all+sync+profile"][2] == 2 * LAYERS  # a forward and a recompute per segment


def test_deepspeed_config_section_and_errors():
    ckpt.configure(None, deepspeed_config={"activation_checkpointing": {"cpu_checkpointing": True, "profile": True}})
    assert ckpt.settings.cpu_checkpointing and ckpt.settings.profile and ckpt.is_configured()
    ckpt.configure(None, deepspeed_config={"activation_checkpointing": {"cpu_checkpointing": True}},
                   checkpoint_in_cpu=False)  # fmt: skip
    assert not ckpt.settings.cpu_checkpointing  # explicit arguments win, as DeepSpeed
    with pytest.raises(ValueError, match="needs partition_activations"):
        ckpt.configure(None, contiguous_checkpointing=True, num_checkpoints=2)
    with pytest.raises(ValueError, match="needs number_checkpoints"):
        ckpt.configure(None, partition_activations=True, contiguous_checkpointing=True)
    with pytest.raises(zero.ConfigError, match="activation_checkpointing.cpu_checkpoint'"):
        ckpt.configure(None, deepspeed_config={"activation_checkpointing": {"cpu_checkpoint": True}})
    ckpt.configure(None, partition_activations=True, contiguous_checkpointing=True, num_checkpoints=2)
    x = torch.randn(3, WIDTH, requires_grad=True)
    with pytest.raises(ValueError, match="number_checkpoints is 2"):
        Net()(x)
    ckpt.reset()
    ckpt.configure(None)


def _engine_body(stage: int):
    results = []
    for kw in ({}, dict(partition_activations=True, checkpoint_in_cpu=True)):
        ckpt.configure(MPU(), **kw)
        zero_cfg = {"stage": stage, "stage3_param_persistence_threshold": 0}
        cfg = {"train_micro_batch_size_per_gpu": 3, "gradient_clipping": 0.0, "zero_optimization": zero_cfg,
               "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}  # fmt: skip
        engine = zero.initialize(model=Net(), config=cfg)[0]
        x = torch.randn(2, 3, WIDTH, generator=torch.Generator().manual_seed(4))[0]  # the same on both ranks
        losses = []
        for _ in range(2):
            torch.manual_seed(50)  # model-parallel ranks draw the same dropout masks (replicated activations)
            loss = F.mse_loss(engine(x), torch.ones(3, 1))
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach())
        results.append((losses, engine.runtime.full_parameters()))
    ckpt.configure(None)
    (l0, p0), (l1, p1) = results
    return all(torch.equal(a, b) for a, b in zip(l0, l1)) and all(torch.equal(p0[k], p1[k]) for k in p0)


@pytest.mark.parametrize("stage", [0, 3])
def test_options_through_the_engine_equal_plain_recompute(stage):
    assert run_ranks(_engine_body, 2, stage, timeout=120) == [True, True]
