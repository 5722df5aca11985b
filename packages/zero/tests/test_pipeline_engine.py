"""``zero.initialize`` with a ``PipelineModule`` (DeepSpeed's ``deepspeed.pipe``): ``train_batch`` over 2 and 3
stages, and 2 stages x 2 data-parallel replicas with ZeRO-1, equals one process running the same micro-batches
with gradient accumulation (the returned loss each step, and every parameter of every stage, fp32, within 1e-6 in
relative L2 norm; with 2 replicas ZeRO-1 and ZeRO-2; 1e-5 with the layers compiled, as inductor reorders float
sums):

* SGD with momentum and an active gradient clip (the norm is taken over every stage and replica);
* AdamW with an embedding whose weight is tied to the output layer on another stage (its gradient summed over
  the two stages), and SGD with it and a clip (the tied weight counted once in the norm);
* for three of these runs, the losses DeepSpeed 0.19.8's own PipelineEngine returned on the same inputs;
* ``eval_batch`` returns the mean loss of its micro-batches on every stage, and the last micro-batch's outputs
  with ``return_logits``;
* the interleaved 1F1B schedule (two virtual stages per rank, beyond DeepSpeed) equals one process too, for tied
  and untied layers, in training and ``eval_batch``;
* the eager 1F1B (``pipeline.schedule: "eager_1f1b"``, beyond DeepSpeed: a longer warm-up) equals one process on
  2 stages (tied layers, SGD, a clip);
* with the bf16 section on (bf16 weights and activations, fp32 master weights), 2 stages equal zero's plain engine
  on the same layers and micro-batches bitwise (AdamW, a clip; the loss averaged in bf16, as DeepSpeed does);
* the zero-bubble schedule (ZB-H1, ``pipeline.schedule: "zero_bubble"``, beyond DeepSpeed) equals one process on 3
  stages (tied layers, AdamW) and on 2 stages x 2 replicas with ZeRO-2 and a clip;
* a checkpoint saved per stage resumes bitwise (the next batch's loss and every parameter); loaded at another
  pipeline degree (1 stage of 2 replicas, 3 stages) it gives the saved weights and, its AdamW state carried, the
  next batch's loss and parameters, as does a plain zero engine over an ``nn.Sequential`` of the same layers;
  ``zero_to_fp32`` of its folder is the whole model's state dict;
* with the stages' layers compiled by ``engine.compile()``: 2 stages x 2 replicas, ZeRO-1, AdamW, tied layers; and
  the interleaved schedule on 2 ranks (tied layers, AdamW);
* wrong inputs raise on every rank: a data iterator that runs out mid-batch, ZeRO-3, ``num_stages`` not dividing
  the world size, a partition leaving a stage without layers.

* 2 stages x 2 tensor-parallel ranks (AutoTP splitting each stage's MLP on the topology's model axis) with a
  clip: the losses and every parameter gathered whole; the same for a tiny transformers Llama cut by the Hugging
  Face split (AutoTP's Llama rules inside each stage);

One launch per world size (2, 3, 4 gloo ranks) holds all of its checks.
"""

import math
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zero
from zero.checkpoint_tools.to_fp32 import (
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
)
from zero.config import ConfigError, NotSupportedError
from zero.engine.tensor_parallel import gather_full_state
from zero_comm.testing import run_ranks
from zero_parallel import layout_of
from zero_parallel.pipe import (
    LayerSpec,
    PipelineError,
    PipelineModule,
    PipeModelDataParallelTopology,
    TiedLayerSpec,
    set_random_seed,
)

WIDTH, HIDDEN, MICRO, GAS, STEPS, SEED = 6, 8, 2, 3, 3, 1234

# what DeepSpeed 0.19.8's PipelineEngine.train_batch returned for the same layers, seeds, data and config (gloo on
# CPU, torchrun, DeepSpeed's own PipelineModule with seed_layers): (layers, optimizer, stages, ZeRO stage, clip)
DEEPSPEED_LOSSES = {
    ("untied", "sgd", 2, 1, 0.05): [1.200762391090393, 0.9701063632965088, 1.3369873762130737],
    ("tied", "adamw", 2, 0, 0.0): [1.2332578897476196, 0.9506833553314209, 1.3615831136703491],
    ("untied", "adamw", 3, 1, 0.05): [1.200762391090393, 0.9859144687652588, 1.345596432685852],
}


def _head(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """The output layer reusing the embedding's weight (``[HIDDEN, WIDTH]``) transposed."""
    return x @ module.weight


def _layers(tied: bool) -> list:
    if tied:
        return [TiedLayerSpec("embed", nn.Linear, WIDTH, HIDDEN, bias=False), torch.tanh,
                LayerSpec(nn.Linear, HIDDEN, HIDDEN), torch.tanh,
                TiedLayerSpec("embed", nn.Linear, WIDTH, HIDDEN, bias=False, forward_fn=_head)]  # fmt: skip
    return [LayerSpec(nn.Linear, WIDTH, HIDDEN), torch.tanh, LayerSpec(nn.Linear, HIDDEN, HIDDEN), nn.ReLU(),
            LayerSpec(nn.Linear, HIDDEN, WIDTH)]  # fmt: skip


class _Reference(nn.Module):
    """The whole layer list in one process, each layer built under the seed the pipeline builds it with."""

    def __init__(self, layers: list) -> None:
        super().__init__()
        self.specs = layers
        self.built = nn.ModuleDict()
        self.calls = []
        for i, layer in enumerate(layers):
            set_random_seed(SEED + i)
            if isinstance(layer, TiedLayerSpec):
                if layer.key not in self.built:
                    self.built[layer.key] = layer.build()
                mod = self.built[layer.key]
                self.calls.append(mod if layer.forward_fn is None else (lambda x, f=layer.forward_fn, m=mod: f(m, x)))
            elif isinstance(layer, LayerSpec):
                self.built[str(i)] = layer.build()
                self.calls.append(self.built[str(i)])
            else:
                self.calls.append(layer)

    def forward(self, x):
        for call in self.calls:
            x = call(x)
        return x


def _data(step: int, replica: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * replica + micro)
    return torch.randn(MICRO, WIDTH, generator=g), torch.randn(MICRO, WIDTH, generator=g)


def _stream(replica: int, steps: int = STEPS, gas: int = GAS):
    return iter([_data(s, replica, m) for s in range(steps) for m in range(gas)])


def _optimizer(kind: str, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    # eps 1e-6: Adam's first step moves an element of near-zero gradient by lr * g / (|g| + eps), so rounding-level
    # differences of such gradients are amplified lr / eps times; 1e-6 keeps that within the comparison
    return torch.optim.AdamW(params, lr=0.01, eps=1e-6, weight_decay=0.01)


def _reference_run(tied: bool, kind: str, dp: int, clip: float, gas: int = GAS,
                   layers: list | None = None, op: str = "mean") -> tuple[_Reference, list[float]]:  # fmt: skip
    """One process: each step, each replica's micro-batches accumulated with loss / GAS, averaged over replicas
    (summed with ``op`` "sum"), clipped by the global norm, one optimizer step."""
    ref = _Reference(layers if layers is not None else _layers(tied))
    opt = _optimizer(kind, ref.parameters())
    losses = []
    for step in range(STEPS):
        grads, replica_losses = [], []
        for r in range(dp):
            ref.zero_grad()
            total = torch.zeros(())
            for m in range(gas):
                x, y = _data(step, r, m)
                loss = nn.functional.mse_loss(ref(x), y)
                (loss / gas).backward()
                total += loss.detach()
            replica_losses.append(total / gas)
            grads.append([p.grad.clone() for p in ref.parameters()])
        for p, *gs in zip(ref.parameters(), *grads, strict=True):
            p.grad = sum(gs[1:], gs[0].clone()) / (dp if op == "mean" else 1)
        if clip > 0:
            norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in ref.parameters()))
            for p in ref.parameters():
                p.grad.mul_(min(1.0, clip / (norm + 1e-6)))
        opt.step()
        losses.append(float(sum(replica_losses[1:], replica_losses[0]) / dp))
    return ref, losses


def _config(stage: int, clip: float, gas: int = GAS, schedule: str = "1f1b", op: str = "mean") -> dict:
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas, "gradient_clipping": clip,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
              "gradient_allreduce_op": op}  # fmt: skip
    if schedule != "1f1b":  # the pipeline section is refused for a plain model: left out by default
        config["pipeline"] = {"schedule": schedule}
    return config


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _check_stage(module: PipelineModule, ref: _Reference, what: str, tol: float = 1e-6) -> int:
    """Every parameter of this stage against the reference's; returns how many were compared."""
    checked = 0
    for idx in module._func_layers:
        spec = module._layer_specs[idx]
        if isinstance(spec, TiedLayerSpec):
            mine, theirs = module.tied_modules[spec.key], ref.built[spec.key]
        elif isinstance(spec, LayerSpec):
            mine, theirs = getattr(module, str(idx)), ref.built[str(idx)]
        else:
            continue
        for (name, p), q in zip(mine.named_parameters(), theirs.parameters(), strict=True):
            err = _rel(p.detach(), q.detach())
            assert err <= tol, f"{what}: stage {module.stage_id} layer {idx} {name}: relative error {err:.3g}"
            checked += 1
    return checked


def _train(tied: bool, kind: str, stages: int, stage: int, clip: float, partition: str = "parameters",
           virtual: int = 1, gas: int = GAS, schedule: str = "1f1b", op: str = "mean",
           compiled: bool = False):  # fmt: skip
    """Train the pipeline STEPS batches; compare losses and parameters with the reference (``compiled``: the
    stages' layers compiled by ``engine.compile()``, compared within 1e-5, see the module notes). Returns the
    engine."""
    world = dist.get_world_size()
    dp = world // stages
    module = PipelineModule(_layers(tied), num_stages=stages, loss_fn=nn.functional.mse_loss, seed_layers=True,
                            base_seed=SEED, partition_method=partition, virtual_stages=virtual)  # fmt: skip
    engine, _, _, _ = zero.initialize(model=module, optimizer=lambda ps: _optimizer(kind, ps),
                                      config=_config(stage, clip, gas, schedule, op))  # fmt: skip
    assert engine.schedule == schedule
    tol = 1e-6
    if compiled:
        engine.compile()
        tol = 1e-5
    replica = engine.grid.get_data_parallel_id()
    data = _stream(replica, gas=gas)
    losses = [float(engine.train_batch(data)) for _ in range(STEPS)]
    ref, ref_losses = _reference_run(tied, kind, dp, clip, gas, op=op)
    what = f"{stages} stages x {virtual} chunks x {dp} replicas, {kind}, tied={tied}, ZeRO-{stage}, {schedule}, {op}"
    for step, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
        assert abs(a - b) <= tol * abs(b), f"{what}: step {step} loss {a} != one process's {b}"
    deepspeed = DEEPSPEED_LOSSES.get(("tied" if tied else "untied", kind, stages, stage, clip)) \
        if virtual == 1 and op == "mean" else None  # fmt: skip
    if deepspeed is not None:
        for step, (a, b) in enumerate(zip(losses, deepspeed, strict=True)):
            assert abs(a - b) <= tol * abs(b), f"{what}: step {step} loss {a} != DeepSpeed's {b}"
    assert _check_stage(module, ref, what, tol) > 0
    assert engine.global_steps == STEPS and engine.is_first_stage() == (engine.stage_id == 0)
    assert engine.is_last_stage() == (engine.stage_id == stages - 1)
    return engine, ref


def _eval_checks(engine, ref: _Reference) -> None:
    gas = engine.micro_batches
    batches = [_data(99, engine.grid.get_data_parallel_id(), m) for m in range(gas)]
    loss, logits = engine.eval_batch(iter(batches), return_logits=True)
    with torch.no_grad():
        mine = [nn.functional.mse_loss(ref(x), y) for x, y in batches]
        local = sum(mine[1:], mine[0].clone()) / gas
        dp = engine.grid.get_data_parallel_world_size()
        if dp > 1:
            dist.all_reduce(local)  # every rank holds the reference: the replicas' mean over the world is theirs
            local = local / dist.get_world_size()
    assert abs(float(loss) - float(local)) <= 1e-6 * abs(float(local)), (float(loss), float(local))
    if engine.is_last_stage():
        assert _rel(logits, ref(batches[-1][0]).detach()) <= 1e-6
    else:
        assert logits is None
    with pytest.raises(PipelineError, match="train_batch"):
        engine.forward(batches[0][0])


def _error_checks() -> None:
    world = dist.get_world_size()
    module = PipelineModule(_layers(False), num_stages=2, loss_fn=nn.functional.mse_loss)
    engine, *_ = zero.initialize(model=module, optimizer=lambda ps: _optimizer("sgd", ps), config=_config(1, 0.0))
    with pytest.raises(ValueError, match=r"ran out after 1 of the 3 micro-batches"):
        engine.train_batch(iter([_data(0, 0, 0)]))  # every rank raises, the middle ones too
    with pytest.raises(ValueError, match=r"micro-batch 0 on stage \d is a Tensor, not an \(inputs, labels\) pair"):
        engine.train_batch(iter([torch.zeros(2, WIDTH)] * GAS))
    with pytest.raises(NotSupportedError, match=r"zero_optimization\.stage"):
        zero.initialize(model=module, optimizer=lambda ps: _optimizer("sgd", ps), config=_config(3, 0.0))
    with pytest.raises(ValueError, match=rf"num_stages={world + 1} does not divide the world size {world}"):
        PipelineModule(_layers(False), num_stages=world + 1)
    with pytest.raises(ValueError, match=r"leaves stage\(s\) \[1\] without layers"):
        PipelineModule([nn.Linear(2, 2)], num_stages=2, partition_method="uniform")
    with pytest.raises(NotSupportedError, match=r"fp16\.enabled"):
        zero.initialize(model=module, optimizer=lambda ps: _optimizer("sgd", ps),
                        config={**_config(1, 0.0), "fp16": {"enabled": True}})  # fmt: skip


def _build_tied(stages: int, seed: int = SEED + 7, partition: str = "parameters"):
    module = PipelineModule(_layers(True), num_stages=stages, loss_fn=nn.functional.mse_loss, seed_layers=True,
                            base_seed=seed, partition_method=partition)  # fmt: skip
    engine, *_ = zero.initialize(model=module, optimizer=lambda ps: _optimizer("adamw", ps), config=_config(1, 0.0))
    return module, engine


def _whole(module: PipelineModule) -> dict[str, torch.Tensor]:
    """Every stage's ``state_dict()`` merged on every rank (a tied key once)."""
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, {k: v.clone() for k, v in module.state_dict().items()})
    out = {}
    for part in parts:
        for k, v in part.items():
            out.setdefault(k, v)
    return out


def _save_two_stages(root: str) -> tuple[PipelineModule, torch.Tensor]:
    """2 stages (2 ranks): train two batches, save, train a third; rank 0 writes the third batch's loss and the
    whole model before and after it to ``root/expected.pt``."""
    module, engine = _build_tied(2)
    data = _stream(0)
    engine.train_batch(data), engine.train_batch(data)
    assert engine.save_checkpoint(root, client_state={"epoch": 4}) is True
    with open(os.path.join(root, "latest")) as f:
        assert f.read() == "global_step2"
    saved = _whole(module)
    loss = engine.train_batch(data)
    after = _whole(module)
    if dist.get_rank() == 0:
        torch.save({"loss": loss, "saved": saved, "after": after}, f"{root}/expected.pt")
    dist.barrier()
    return module, loss


def _two_stage_save(root: str) -> None:
    _save_two_stages(root)


def _check_resharded(root: str, stages: int, partition: str) -> None:
    """A pipeline of ``stages`` stages loads the 2-stage checkpoint (weights and AdamW state) and trains the third
    batch as the 2-stage run did, every replica fed that run's data."""
    expected = torch.load(f"{root}/expected.pt")
    module, engine = _build_tied(stages, seed=SEED + 99, partition=partition)  # other initial weights
    _, client = engine.load_checkpoint(root)
    assert client == {"epoch": 4} and engine.global_steps == 2
    what = f"2 stages resharded to {stages}"
    for k, v in module.state_dict().items():
        assert torch.equal(v, expected["saved"][k]), f"{what}: {k} differs after loading"
    loss = engine.train_batch(iter([_data(2, 0, m) for m in range(GAS)]))
    assert abs(float(loss) - float(expected["loss"])) <= 1e-6 * abs(float(expected["loss"])), what
    for k, v in module.state_dict().items():
        assert _rel(v, expected["after"][k]) <= 1e-6, f"{what}: {k} differs after the next batch"
    consolidated = get_fp32_state_dict_from_zero_checkpoint(root)  # zero_to_fp32 of the pipeline folder
    assert sorted(consolidated) == sorted(expected["saved"])
    for k, v in consolidated.items():
        assert torch.equal(v, expected["saved"][k]), f"zero_to_fp32: {k}"


def _resume_checks(root: str) -> None:
    """Save after two batches, train a third; a new engine loading the checkpoint trains the third bitwise alike;
    one stage of two replicas (no pipeline) loads it too."""
    module, loss = _save_two_stages(root)
    after = {k: v.clone() for k, v in module.state_dict().items()}
    module, engine = _build_tied(2, seed=SEED + 99)  # other initial weights: the load must replace them
    path, client = engine.load_checkpoint(root)
    assert client == {"epoch": 4} and engine.global_steps == 2
    assert path.startswith(os.path.join(root, f"pipe_stage_{engine.stage_id:02d}", "global_step2", "")), path
    third = iter([_data(2, engine.grid.get_data_parallel_id(), m) for m in range(GAS)])
    assert torch.equal(engine.train_batch(third), loss)
    for k, v in module.state_dict().items():
        assert torch.equal(v, after[k]), f"stage {engine.stage_id}: {k} differs after resuming"
    _check_resharded(root, 1, "parameters")
    with pytest.raises(NotSupportedError, match="is a pipeline checkpoint"):
        convert_zero_checkpoint_to_fp32_state_dict(root, f"{root}/fp32")
    with pytest.raises(ValueError, match=r"is not a pipeline checkpoint"):
        engine.load_checkpoint(f"{root}/pipe_stage_00")


def _plain_engine_checks(root: str) -> None:
    """2 stages of untied layers saved after two batches load into a plain zero engine (no pipeline: 2 replicas of
    an ``nn.Sequential`` of the same layers, whose parameter names match), which trains the third batch as the
    pipeline did, each replica fed its data."""
    module = PipelineModule(_layers(False), num_stages=2, loss_fn=nn.functional.mse_loss, seed_layers=True,
                            base_seed=SEED)  # fmt: skip
    engine, *_ = zero.initialize(model=module, optimizer=lambda ps: _optimizer("adamw", ps), config=_config(1, 0.0))
    data = _stream(0)
    engine.train_batch(data), engine.train_batch(data)
    engine.save_checkpoint(root)
    saved = _whole(module)
    want = float(engine.train_batch(data))
    after = _whole(module)
    set_random_seed(SEED + 50)  # other initial weights: the load must replace them
    seq = nn.Sequential(nn.Linear(WIDTH, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                        nn.Linear(HIDDEN, WIDTH))  # fmt: skip
    plain, *_ = zero.initialize(model=seq, optimizer=lambda ps: _optimizer("adamw", ps), config=_config(1, 0.0))
    plain.load_checkpoint(root)
    assert plain.global_steps == 2
    for k, v in seq.state_dict().items():
        assert torch.equal(v, saved[k]), f"plain engine: {k} differs after loading"
    total = 0.0
    for m in range(GAS):
        x, y = _data(2, 0, m)
        loss = nn.functional.mse_loss(plain(x), y)
        plain.backward(loss)
        plain.step()
        total += float(loss.detach())
    assert abs(total / GAS - want) <= 1e-6 * abs(want), (total / GAS, want)
    for k, v in seq.state_dict().items():
        assert _rel(v, after[k]) <= 1e-6, f"plain engine: {k} differs after the next batch"


def _bf16_checks() -> None:
    """The bf16 section on (bf16 weights and activations, fp32 master weights): 2 stages of untied layers train as
    zero's plain engine trains the same layers (each replica fed the same micro-batches: one process's gradients),
    which the bf16 tests of the plain engine hold against PyTorch."""
    config = {**_config(1, 0.05), "bf16": {"enabled": True}}
    batches = [tuple(t.bfloat16() for t in _data(s, 0, m)) for s in range(STEPS) for m in range(GAS)]
    module = PipelineModule(_layers(False), num_stages=2, loss_fn=nn.functional.mse_loss, seed_layers=True,
                            base_seed=SEED)  # fmt: skip
    engine, *_ = zero.initialize(model=module, optimizer=lambda ps: _optimizer("adamw", ps), config=config)
    data = iter(batches)
    losses = [float(engine.train_batch(data)) for _ in range(STEPS)]
    ref = _Reference(_layers(False))
    plain, *_ = zero.initialize(model=ref, optimizer=lambda ps: _optimizer("adamw", ps), config=config)
    want = []
    for step in range(STEPS):
        total = torch.zeros((), dtype=torch.bfloat16)  # the mean in the loss's dtype, as DeepSpeed's train_batch
        for x, y in batches[step * GAS : (step + 1) * GAS]:
            loss = nn.functional.mse_loss(plain(x), y)
            plain.backward(loss)
            plain.step()
            total += loss.detach()
        want.append(float(total / GAS))
    assert losses == pytest.approx(want, rel=1e-6, abs=0), (losses, want)
    assert all(p.dtype == torch.bfloat16 for p in module.parameters())
    assert _check_stage(module, ref, "bf16, 2 stages, AdamW, clip", tol=0.0) > 0


def _two_ranks(root: str) -> None:
    engine, ref = _train(tied=False, kind="sgd", stages=2, stage=1, clip=0.05)
    _eval_checks(engine, ref)
    _train(tied=True, kind="adamw", stages=2, stage=0, clip=0.0)
    _error_checks()
    _resume_checks(root)
    _plain_engine_checks(f"{root}/untied")
    _interleaved_checks()
    # eager 1F1B (a longer warm-up, activations sent at once): 1F1B's gradients, with tied layers and a clip
    engine, _ = _train(tied=True, kind="sgd", stages=2, stage=1, clip=0.05, schedule="eager_1f1b")
    assert engine.executor.virtual_stages == 1
    _bf16_checks()


def _interleaved_checks() -> None:
    """Two virtual stages per rank (layers cut in 4, round the 2 ranks twice), 4 micro-batches per batch."""
    engine, ref = _train(tied=True, kind="adamw", stages=2, stage=1, clip=0.0, partition="uniform", virtual=2, gas=4)
    assert engine.pipeline_module._chunk_layers == ([(0, 2), (3, 4)] if engine.stage_id == 0 else [(2, 3), (4, 5)])
    _eval_checks(engine, ref)
    _train(tied=False, kind="sgd", stages=2, stage=1, clip=0.05, partition="uniform", virtual=2, gas=4)
    _train(tied=True, kind="adamw", stages=2, stage=1, clip=0.0, partition="uniform", virtual=2, gas=4, compiled=True)
    module = PipelineModule(_layers(False), num_stages=2, loss_fn=nn.functional.mse_loss, virtual_stages=2,
                            partition_method="uniform")  # fmt: skip
    with pytest.raises(NotSupportedError, match=r"pipeline\.schedule.*virtual_stages=2"):
        zero.initialize(model=module, optimizer=lambda ps: _optimizer("sgd", ps),
                        config=_config(1, 0.0, gas=4, schedule="zero_bubble"))  # fmt: skip
    with pytest.raises(ConfigError, match=r"pipeline\.schedule.*'gpipe' is not one of"):
        zero.initialize(model=module, optimizer=lambda ps: _optimizer("sgd", ps), config=_config(1, 0.0, 4, "gpipe"))
    with pytest.raises(ConfigError, match="gradient_accumulation_steps"):
        module = PipelineModule(_layers(False), num_stages=2, loss_fn=nn.functional.mse_loss, virtual_stages=2,
                                partition_method="uniform")  # fmt: skip
        zero.initialize(model=module, optimizer=lambda ps: _optimizer("sgd", ps), config=_config(1, 0.0, gas=3))


def _three_ranks(root: str) -> None:
    _check_resharded(root, 3, "uniform")
    _train(tied=False, kind="adamw", stages=3, stage=1, clip=0.05, partition="uniform")
    _train(tied=True, kind="sgd", stages=3, stage=1, clip=0.05, partition="uniform")  # the tied weight counted once
    _train(tied=True, kind="adamw", stages=3, stage=1, clip=0.0, partition="uniform", gas=4, schedule="zero_bubble")


def _four_ranks() -> None:
    engine, ref = _train(tied=True, kind="adamw", stages=2, stage=1, clip=0.0)
    _eval_checks(engine, ref)
    _train(tied=False, kind="sgd", stages=2, stage=2, clip=0.05)  # ZeRO-2, which DeepSpeed refuses, trains the same
    _train(tied=False, kind="sgd", stages=2, stage=2, clip=0.05, schedule="zero_bubble")
    # gradient_allreduce_op "sum": every stage's gradients are the replicas' sum (the factor applied once)
    _train(tied=False, kind="sgd", stages=2, stage=1, clip=0.0, op="sum")
    _train(tied=True, kind="adamw", stages=2, stage=1, clip=0.0, compiled=True)  # the layers under inductor
    _train(tied=False, kind="sgd", stages=2, stage=2, clip=0.0, schedule="zero_bubble", op="sum")
    _tensor_parallel_checks()
    _hf_tensor_parallel_checks()


def _mlp_layers() -> list:
    """Two Megatron MLP blocks (a column-split Linear, tanh, a row-split Linear), one per stage."""
    return [LayerSpec(nn.Linear, WIDTH, HIDDEN), torch.tanh, LayerSpec(nn.Linear, HIDDEN, WIDTH),
            LayerSpec(nn.Linear, WIDTH, HIDDEN), torch.tanh, LayerSpec(nn.Linear, HIDDEN, WIDTH)]  # fmt: skip


def _tensor_parallel_checks() -> None:
    """2 stages x 2 tensor-parallel ranks (AutoTP inside each stage, one mesh), AdamW, ZeRO-1, a clip: equal to
    one process (every parameter gathered whole over the tensor-parallel ranks)."""
    topology = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1)
    module = PipelineModule(_mlp_layers(), topology=topology, loss_fn=nn.functional.mse_loss, seed_layers=True,
                            base_seed=SEED, partition_method="uniform")  # fmt: skip
    specs = [{"patterns": [r"^(0|3)\.weight$"], "partition_type": "column"},
             {"patterns": [r"^(2|5)\.weight$"], "partition_type": "row"}]  # fmt: skip
    config = {**_config(1, 0.05), "tensor_parallel": {"autotp_size": 2, "partition_config": {
        "use_default_specs": False, "layer_specs": specs}}}  # fmt: skip
    engine, *_ = zero.initialize(model=module, optimizer=lambda ps: _optimizer("adamw", ps), config=config)
    layout = layout_of(module)
    assert layout is not None and len(layout.shards) == 3  # a column weight and bias, a row weight per stage
    data = _stream(0)
    losses = [float(engine.train_batch(data)) for _ in range(STEPS)]
    ref, ref_losses = _reference_run(False, "adamw", 1, 0.05, layers=_mlp_layers())
    for step, (a, b) in enumerate(zip(losses, ref_losses, strict=True)):
        assert abs(a - b) <= 1e-6 * abs(b), f"pp 2 x tp 2: step {step} loss {a} != one process's {b}"
    whole = gather_full_state(module.state_dict(), layout)
    for key, value in whole.items():
        idx, _, attr = key.partition(".")
        err = _rel(value, getattr(ref.built[idx], attr).detach())
        assert err <= 1e-6, f"pp 2 x tp 2: stage {engine.stage_id} {key}: relative error {err:.3g}"
    with pytest.raises(NotSupportedError, match="tensor parallelism"):
        engine.save_checkpoint("/nonexistent-pipeline-tp")
    with pytest.raises(ConfigError, match=r"tensor_parallel\.autotp_size.*'model' axis is 2 long"):
        zero.initialize(model=module, optimizer=lambda ps: _optimizer("sgd", ps), config=_config(1, 0.0))


def _hf_tensor_parallel_checks() -> None:
    """A tiny transformers Llama cut by the Hugging Face split into 2 stages x 2 tensor-parallel ranks (AutoTP's
    built-in Llama rules, the heads split), AdamW, a clip: equal to the model trained in one process."""
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM

    from zero_parallel.pipe import causal_lm_loss, decoder_layers

    torch.manual_seed(7)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=48, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8,
                                         attn_implementation="sdpa"))  # fmt: skip
    ref = copy.deepcopy(model)
    hf_names = {id(p): n for n, p in model.named_parameters()}
    module = PipelineModule(decoder_layers(model), loss_fn=causal_lm_loss,
                            topology=PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1))  # fmt: skip
    names = {k: hf_names[id(p)] for k, p in module.named_parameters()}  # before AutoTP replaces the Linears
    config = {**_config(1, 0.5, gas=2), "tensor_parallel": {"autotp_size": 2}}
    engine, *_ = zero.initialize(model=module, optimizer=lambda ps: _optimizer("adamw", ps), config=config)
    ref_opt = _optimizer("adamw", ref.parameters())
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        ids = [torch.randint(0, 48, (MICRO, 8), generator=g) for _ in range(2)]
        loss = float(engine.train_batch(iter([(x, x) for x in ids])))
        want = 0.0
        for x in ids:
            out = ref(input_ids=x, labels=x).loss
            (out / 2).backward()
            want += float(out.detach()) / 2
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)  # max_norm / (norm + 1e-6), as zero clips
        ref_opt.step()
        ref_opt.zero_grad()
        assert abs(loss - want) <= 1e-6 * want, f"Llama pp 2 x tp 2: step {step} loss {loss} != one process's {want}"
    theirs = dict(ref.named_parameters())
    for key, value in gather_full_state(module.state_dict(), layout_of(module)).items():
        err = _rel(value, theirs[names[key]].detach())
        assert err <= 1e-6, f"Llama pp 2 x tp 2: stage {engine.stage_id} {names[key]}: relative error {err:.3g}"


def test_two_stages_match_one_process_resume_bitwise_and_refuse_wrong_inputs_on_every_rank(tmp_path):
    run_ranks(_two_ranks, 2, str(tmp_path), timeout=240)


def test_three_stages_match_one_process_and_load_a_two_stage_checkpoint(tmp_path):
    run_ranks(_two_stage_save, 2, str(tmp_path), timeout=120)
    run_ranks(_three_ranks, 3, str(tmp_path), timeout=240)


def test_two_stages_by_two_replicas_with_zero1_and_zero2_match_one_process():
    run_ranks(_four_ranks, 4, timeout=300)
