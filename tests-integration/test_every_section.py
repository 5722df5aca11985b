"""A DeepSpeed config carrying every section the guides use (monitors, every activation-checkpointing option,
torch_autocast, a non-Adam optimizer, a scheduler) loads and trains 3 steps on 2 ranks; the monitors' files hold
the expected tags with one value per step, and the loss stays finite. The 1-bit optimizers (stage 0, fp32, no
autocast) get the same check in their own config."""

import csv
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

import zero
import zero.activation_checkpointing.api as ckpt
from zero_comm.testing import run_ranks

TAGS = ("Train/Samples/train_loss", "Train/Samples/lr", "Train/Samples/grad_norm")


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))
        self.head = torch.nn.Linear(16, 2)

    def forward(self, x):
        for b in self.blocks:
            x = ckpt.checkpoint(lambda t, b=b: F.gelu(b(t)), x)
        return self.head(x)


def config(out_dir: str, optimizer: dict, stage: int, autocast: bool) -> dict:
    monitors = {
        "tensorboard": {"enabled": True, "output_path": out_dir, "job_name": "tb"},
        "csv_monitor": {"enabled": True, "output_path": out_dir, "job_name": "csv"},
        "wandb": {"enabled": True, "project": "every-section", "group": "g"},
        "comet": {"enabled": False, "samples_log_interval": 1, "project": "p"},
    }  # comet_ml is not installed
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
            "steps_per_print": 1, "optimizer": optimizer,
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 2}},
            "zero_optimization": {"stage": stage},
            "activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True,
                                         "contiguous_memory_optimization": True, "number_checkpoints": 3,
                                         "synchronize_checkpoint_boundary": True, "profile": True},
            "torch_autocast": {"enabled": autocast, "dtype": "bfloat16",
                               "lower_precision_safe_modules": ["torch.nn.Linear"]},
            **monitors}  # fmt: skip


def _body(out_dir: str, optimizer: dict, stage: int, autocast: bool):
    rank = dist.get_rank()
    os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=out_dir)
    cfg = config(out_dir, optimizer, stage, autocast)
    ckpt.configure(None, deepspeed_config=cfg)  # as Megatron-DeepSpeed: no mpu, so nothing to slice over
    engine = zero.initialize(model=Net(), config=cfg)[0]
    g = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(3 * 2):
        loss = F.mse_loss(engine(torch.randn(2, 16, generator=g)).float(), torch.randn(2, 2, generator=g))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    engine.close_monitor()
    recomputed = sum(1 for phase, _ in ckpt.timings() if phase == "recompute")
    ckpt.configure(None)
    return losses, engine.global_steps, recomputed


def _check(tmp_path, results):
    for losses, steps, recomputed in results:
        assert steps == 3 and all(torch.isfinite(torch.tensor(losses))) and recomputed == 3 * 6
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    for tag in TAGS:
        assert [e.step for e in acc.Scalars(tag)] == [8, 16, 24], tag
        rows = list(csv.reader(open(tmp_path / "csv" / (tag.replace("/", "_") + ".csv"))))
        assert [r[0] for r in rows[1:]] == ["8", "16", "24"], tag
    assert len(list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))) == 1


def test_every_section_with_lamb_and_autocast(tmp_path):
    opt = {"type": "Lamb", "params": {"lr": 1e-3, "weight_decay": 0.01}}
    _check(tmp_path, run_ranks(_body, 2, str(tmp_path), opt, 2, True, timeout=180))


def test_every_section_with_onebit_adam(tmp_path):
    opt = {"type": "OneBitAdam", "params": {"lr": 1e-3, "freeze_step": 1, "comm_backend_name": "nccl"}}
    _check(tmp_path, run_ranks(_body, 2, str(tmp_path), opt, 0, False, timeout=180))
