"""``zero_parallel.pipe`` alone, as a third-party runtime would use it (no zero engine): a ``PipelineModule`` over
2 gloo ranks, ``StageExecutor`` running DeepSpeed's 1F1B ``TrainSchedule`` for the first batch and the zero-bubble
``ZeroBubbleTrainSchedule`` (backward split into input- and weight-gradient passes, the stage's Linear weight
gradients deferred to the weight pass through a ``WeightGradStore``) for the others, with a plain torch
SGD step per stage (through the ``StageTraining`` protocol), and ``InferenceSchedule`` for evaluation. After three
batches of four micro-batches every parameter equals a one-process run with gradient accumulation (fp32, 1e-6
relative), tied weights included (their gradients summed by ``allreduce_tied_weight_gradients``), and each
micro-batch's loss and the evaluation outputs are the one process's.
"""

import torch
import torch.distributed as dist
from torch import nn

from zero_comm.testing import run_ranks
from zero_parallel.pipe import (
    InferenceSchedule,
    LayerSpec,
    PipelineModule,
    StageExecutor,
    TiedLayerSpec,
    TrainSchedule,
    WeightGradStore,
    ZeroBubbleTrainSchedule,
    set_random_seed,
)
from zero_parallel.pipe.weight_grad import weight_root

WIDTH, MICRO, GAS, STEPS, SEED, LR = 5, 3, 4, 3, 99, 0.2


def _head(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return x @ module.weight


def _layers() -> list:
    return [TiedLayerSpec("embed", nn.Linear, WIDTH, 7, bias=False), torch.tanh, LayerSpec(nn.Linear, 7, 7),
            torch.tanh, TiedLayerSpec("embed", nn.Linear, WIDTH, 7, bias=False, forward_fn=_head)]  # fmt: skip


def _batch(step: int, micro: int):
    g = torch.Generator().manual_seed(100 * step + micro)
    return torch.randn(MICRO, WIDTH, generator=g), torch.randn(MICRO, WIDTH, generator=g)


class _SGDStage:
    """StageTraining with torch: loss / GAS backward, tied gradients summed over their stages, plain SGD."""

    def __init__(self, module: PipelineModule) -> None:
        self.module = module
        self.opt = torch.optim.SGD(module.parameters(), lr=LR)

    def backward_loss(self, loss, last_micro_batch):
        (loss / GAS).backward()

    def backward_outputs(self, outputs, grads, last_micro_batch):
        torch.autograd.backward(outputs, grads)

    def reduce_tied_grads(self):
        self.module.allreduce_tied_weight_gradients()

    def reduce_grads(self):
        """One replica per stage: nothing to reduce."""

    def optimizer_step(self):
        self.opt.step()
        self.opt.zero_grad()


def _reference():
    built, calls = {}, []
    for i, layer in enumerate(_layers()):
        set_random_seed(SEED + i)
        if isinstance(layer, TiedLayerSpec):
            mod = built.setdefault(layer.key, layer.build())
            calls.append(mod if layer.forward_fn is None else (lambda x, f=layer.forward_fn, m=mod: f(m, x)))
        elif isinstance(layer, LayerSpec):
            calls.append(built.setdefault(str(i), layer.build()))
        else:
            calls.append(layer)

    def run(x):
        for call in calls:
            x = call(x)
        return x

    params = [p for m in built.values() for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=LR)
    losses = []
    for step in range(STEPS):
        for m in range(GAS):
            x, y = _batch(step, m)
            loss = nn.functional.mse_loss(run(x), y)
            (loss / GAS).backward()
            losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        outputs = run(_batch(50, GAS - 1)[0])
    return built, losses, outputs


def _body() -> None:
    module = PipelineModule(_layers(), num_stages=2, loss_fn=nn.functional.mse_loss, seed_layers=True,
                            base_seed=SEED, partition_method="uniform")  # fmt: skip
    stage = module.stage_id
    group = module.mpu().get_pipe_parallel_group()
    store = WeightGradStore()
    assert store.install(module) >= 1  # the tied embedding (stage 1 runs it through its forward_fn, not deferred)
    executor = StageExecutor(module, module.loss_fn, stage, 2, group, torch.device("cpu"), weight_grads=store)
    training = _SGDStage(module)
    losses = []
    for step in range(STEPS):
        batches = [_batch(step, m) for m in range(GAS)]
        schedule = TrainSchedule if step == 0 else ZeroBubbleTrainSchedule
        executor.run(schedule(GAS, 2, stage), batches, training)
        losses += executor.losses
    with torch.no_grad():
        executor.run(InferenceSchedule(GAS, 2, stage), [_batch(50, m) for m in range(GAS)], None)
    built, ref_losses, ref_outputs = _reference()
    if stage == 1:
        assert len(losses) == STEPS * GAS
        for a, b in zip(losses, ref_losses, strict=True):
            assert abs(float(a) - float(b)) <= 1e-6 * abs(float(b)), (float(a), float(b))
        assert float((executor.last_outputs - ref_outputs).norm() / ref_outputs.norm()) <= 1e-6
    else:
        assert losses == [] and executor.last_outputs is None
    mine = {f"tied_modules.{k}" if k == "embed" else k: v for k, v in built.items()}
    for name, p in module.named_parameters():
        owner, _, attr = name.rpartition(".")
        ref = getattr(mine[owner], attr)
        err = float((p.detach() - ref.detach()).norm() / ref.detach().norm())
        assert err <= 1e-6, f"stage {stage}: {name} relative error {err:.3g}"
    dist.barrier()


def test_executor_with_a_plain_torch_optimizer_matches_one_process():
    run_ranks(_body, 2, timeout=120)


def test_weight_grad_store_defers_linear_weight_gradients_to_the_weight_pass():
    """While deferring, a Linear's backward gives its input's gradient alone (no gradient hook of its weight fires)
    and queues the weight work; the queue's root then gives the weight and bias the gradients of a plain backward
    (fp32, 1e-6 relative); not deferring, the backward is the plain one."""
    torch.manual_seed(SEED)
    layer, norm = nn.Linear(6, 4), nn.LayerNorm(6)
    x, g = torch.randn(2, 3, 6, requires_grad=True), torch.randn(2, 3, 4)
    layer(norm(x)).backward(g)
    plain = [t.grad.clone() for t in (x, layer.weight, layer.bias, norm.weight)]
    for t in (x, layer.weight, layer.bias, norm.weight, norm.bias):
        t.grad = None
    fired = []
    layer.weight.register_post_accumulate_grad_hook(lambda p: fired.append(p.grad is not None))
    store = WeightGradStore()
    assert store.install(nn.Sequential(norm, layer)) == 1
    store.deferring = True
    store.start()
    layer(norm(x)).backward(g)
    queue = store.take()
    assert len(queue) == 1 and layer.weight.grad is None and layer.bias.grad is None and fired == []
    assert x.grad is not None and norm.weight.grad is not None  # the input pass: inputs and the other parameters
    weight_root(queue).backward()
    assert fired == [True]
    for mine, ref in zip((x.grad, layer.weight.grad, layer.bias.grad, norm.weight.grad), plain, strict=True):
        assert float((mine - ref).norm() / ref.norm()) <= 1e-6
    store.deferring = False
    for t in (x, layer.weight, layer.bias):
        t.grad = None
    layer(norm(x)).backward(g)  # not deferring: the plain backward
    assert float((layer.weight.grad - plain[1]).norm() / plain[1].norm()) <= 1e-6 and store.queue == []
