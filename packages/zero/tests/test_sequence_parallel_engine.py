"""``zero.initialize(mpu=...)`` with the Ulysses mpu, as Accelerate drives it: transformers' tiny Llama at sp=2 x dp=1
(2 gloo ranks), ZeRO-2 and ZeRO-3 sharded over the sequence-data-parallel group, each rank feeding its half of every
sequence, the loss combined by ``sequence_parallel_loss``, AdamW, 3 steps: the gradient norms and the parameters
equal a single-process run on the whole sequences. Bad mpus and mismatched sizes are refused before any work."""

import copy

import pytest
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

import zero
from zero import parallel_groups as groups
from zero.engine.sequence_parallel import parallel_groups
from zero_comm.testing import run_ranks
from zero_parallel import (
    IGNORE_INDEX,
    SequenceParallelMPU,
    UlyssesSPAttentionHF,
    sequence_parallel_loss,
    unregister_from_transformers,
)

SP, BATCH, SEQ, STEPS, LR = 2, 2, 12, 3, 1e-2


def _tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)  # the same weights on every rank
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attn_implementation="sdpa")  # fmt: skip
    return LlamaForCausalLM(config)


def _batches(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(input_ids, labels)`` per step, ``[BATCH, SEQ]`` int64; a prompt of SEQ // 3 positions is not counted."""
    out = []
    for step in range(steps):
        ids = torch.randint(0, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))
        labels = ids.clone()
        labels[:, : SEQ // 3] = IGNORE_INDEX
        out.append((ids, labels))
    return out


def _reference(model: LlamaForCausalLM, steps: int = STEPS) -> tuple[dict, list[float]]:
    """One process, whole sequences: AdamW with clipping at 1.0 (zero's default gradient_clipping)."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    norms = []
    for ids, labels in _batches(steps):
        opt.zero_grad()
        model(input_ids=ids, labels=labels).loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, norms


def _train_sequence_parallel(stage: int, save_dir: str | None = None, predivide: float = 1.0) -> dict:
    model = _tiny_llama()
    want, want_norms = _reference(model)  # before registering: plain sdpa on the whole sequence
    cfg = {"train_batch_size": BATCH, "train_micro_batch_size_per_gpu": BATCH,  # dp=1: micro x gas x 1
           "sequence_parallel_size": SP, "zero_optimization": {"stage": stage},
           "gradient_predivide_factor": predivide}  # fmt: skip
    try:
        mpu = UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", SP, BATCH, seq_length_is_variable=True)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        engine, *_ = zero.initialize(model=model, optimizer=opt, config=cfg, mpu=mpu)
        rank, group = groups._get_sequence_parallel_rank(), groups._get_sequence_parallel_group()
        seen = {"sp": groups._get_sequence_parallel_world_size(), "dp": groups._get_data_parallel_world_size(),
                "sdp": groups._get_sequence_data_parallel_world_size(), "shard_world": engine.world_size}  # fmt: skip
        shard = slice(rank * SEQ // SP, (rank + 1) * SEQ // SP)
        norms = []
        for ids, labels in _batches():  # each rank its half of every sequence, shift_labels shifted over the whole
            shift = torch.cat([labels[:, 1:], torch.full((BATCH, 1), IGNORE_INDEX)], dim=1)[:, shard].contiguous()
            positions = torch.arange(SEQ).expand(BATCH, -1)[:, shard]
            out = engine(input_ids=ids[:, shard], position_ids=positions, labels=shift, shift_labels=shift)
            engine.backward(sequence_parallel_loss(out.loss, shift, group))
            engine.step()
            norms.append(engine.get_global_grad_norm())
        if save_dir is not None:
            engine.save_checkpoint(save_dir)
        engine.destroy()  # plain dense parameters holding the trained values; groups forgets the mpu
        seen["after_destroy"] = groups._get_sequence_parallel_world_size()
    finally:
        unregister_from_transformers("sdpa")
    # relative error of each parameter tensor: ||got - want|| / ||want||
    worst = max(((p.detach() - want[n]).norm() / want[n].norm()).item() for n, p in model.named_parameters())
    worst_abs = max((p.detach() - want[n]).abs().max().item() for n, p in model.named_parameters())
    moved = min((p.detach() - q).abs().max().item() for p, q in zip(_tiny_llama().parameters(), want.values()))
    return {**seen, "worst": worst, "worst_abs": worst_abs, "norms": norms, "want_norms": want_norms, "moved": moved}


@pytest.mark.parametrize("stage", [2, 3])
def test_ulysses_llama_through_initialize_equals_the_whole_sequence_run(stage):
    for out in run_ranks(_train_sequence_parallel, SP, stage, timeout=150):
        assert (out["sp"], out["dp"], out["sdp"], out["shard_world"], out["after_destroy"]) == (2, 1, 2, 2, 1)
        assert out["moved"] > 1e-3  # every parameter tensor was trained away from its initial values
        assert out["worst"] <= 1e-5, (out["worst"], out["worst_abs"], out["norms"], out["want_norms"])
        # the norm reveals a gradient off by a constant factor, which AdamW and clipping would hide
        torch.testing.assert_close(out["norms"], out["want_norms"], rtol=1e-5, atol=0)


def test_gradient_predivide_under_ulysses_equals_the_whole_sequence_run():
    # DeepSpeed divides each gradient by the factor before the reduction over the sequence-data-parallel ranks and
    # by world / factor after it: the mean whatever the factor, so one process's gradients
    for out in run_ranks(_train_sequence_parallel, SP, 2, None, 4.0, timeout=150):
        assert out["moved"] > 1e-3 and out["worst"] <= 1e-5, (out["worst"], out["worst_abs"])
        torch.testing.assert_close(out["norms"], out["want_norms"], rtol=1e-5, atol=0)


def _resume_without_sequence_parallelism(save_dir: str, stage: int) -> tuple[float, float, float]:
    """One process, no mpu: load the sp=2 checkpoint, train one more step on whole sequences."""
    model = _tiny_llama()
    want, want_norms = _reference(model, STEPS + 1)
    cfg = {"train_micro_batch_size_per_gpu": BATCH, "zero_optimization": {"stage": stage}}
    engine, *_ = zero.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=LR), config=cfg)
    engine.load_checkpoint(save_dir)
    loaded = engine.global_steps
    ids, labels = _batches(STEPS + 1)[-1]
    engine.backward(engine(input_ids=ids, labels=labels).loss)
    engine.step()
    norm = engine.get_global_grad_norm()
    engine.destroy()
    worst = max(((p.detach() - want[n]).norm() / want[n].norm()).item() for n, p in model.named_parameters())
    return worst, norm, want_norms[-1], loaded


def test_a_checkpoint_saved_at_sp2_resumes_at_sp1(tmp_path):
    """Parameters, AdamW's moments and step count saved by the sp=2 engine carry on in one process without an mpu:
    its next step equals the fourth step of the whole-sequence run."""
    run_ranks(_train_sequence_parallel, SP, 3, str(tmp_path), timeout=150)
    [(worst, norm, want_norm, loaded)] = run_ranks(_resume_without_sequence_parallelism, 1, str(tmp_path), 3,
                                                   timeout=150)  # fmt: skip
    assert loaded == STEPS
    assert worst <= 1e-5 and abs(norm - want_norm) <= 1e-5 * want_norm, (worst, norm, want_norm)


def _refusals() -> list[str]:
    mpu = SequenceParallelMPU.build(SP)
    msgs = []
    dp_counted = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1}
    for cfg in ({"train_micro_batch_size_per_gpu": 1, "sequence_parallel_size": 4}, dp_counted):
        try:
            zero.initialize(model=torch.nn.Linear(4, 4), optimizer=lambda p: torch.optim.SGD(p, lr=0.1), config=cfg,
                            mpu=mpu)  # fmt: skip
            msgs.append("no error")
        except zero.ConfigError as e:
            msgs.append(str(e))
    msgs.append(f"groups.mpu is {groups.mpu!r}")  # nothing was set by the refused calls
    return msgs


class _AloneMPU:
    """Every group of this rank is the rank alone: sp = dp = 1, so ZeRO must shard over a 1-rank group."""

    def __init__(self, group) -> None:
        self.group = group

    def get_sequence_parallel_group(self):
        return self.group

    def get_sequence_parallel_world_size(self) -> int:
        return 1

    def get_sequence_parallel_rank(self) -> int:
        return 0

    get_data_parallel_group = get_sequence_data_parallel_group = get_sequence_parallel_group
    get_data_parallel_world_size = get_sequence_data_parallel_world_size = get_sequence_parallel_world_size
    get_data_parallel_rank = get_sequence_data_parallel_rank = get_sequence_parallel_rank


def _shards_over_the_mpu_group() -> tuple:
    alone = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]
    mpu = _AloneMPU(alone)
    model = torch.nn.Linear(4, 4)
    cfg = {"train_batch_size": 1, "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2}}
    engine, *_ = zero.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=cfg,
                                 mpu=mpu)  # fmt: skip
    wired = (engine.runtime.group is alone, engine.world_size, groups._get_sequence_data_parallel_group() is alone)
    engine.destroy()
    return wired


def test_zero_shards_over_the_mpus_sequence_data_parallel_group():
    """On 2 ranks, an mpu whose sequence-data-parallel group is each rank alone: ZeRO takes that group (not the
    world) and the batch triple counts its one data-parallel rank."""
    assert run_ranks(_shards_over_the_mpu_group, 2, timeout=60) == [(True, 1, True)] * 2


def test_mismatched_sizes_are_refused_on_every_rank():
    for msgs in run_ranks(_refusals, SP, timeout=60):
        assert "ConfigError: config key 'sequence_parallel_size': 4 differs from the mpu's " \
               "get_sequence_parallel_world_size() = 2; make them equal" in msgs[0]  # fmt: skip
        # the global batch counts data-parallel ranks only: 1 x 1 x dp 1, not x world 2
        assert "train_batch_size=2 must equal train_micro_batch_size_per_gpu=1 x gradient_accumulation_steps=1 x " \
               "world size 1" in msgs[1]  # fmt: skip
        assert msgs[2] == "groups.mpu is None"


class _MegatronMPU:
    """A model-parallel unit without DeepSpeed's sequence-parallel methods."""

    def get_model_parallel_group(self):
        return None

    def get_data_parallel_group(self):
        return None


def test_an_mpu_without_the_sequence_parallel_methods_is_refused_before_any_work():
    # the config path does not exist: the mpu is checked before the config is read or a process group is made
    with pytest.raises(TypeError) as e:
        zero.initialize(model=torch.nn.Linear(2, 2), config="/nonexistent.json", mpu=_MegatronMPU())
    missing = (
        "get_sequence_parallel_group, get_sequence_parallel_world_size, get_sequence_parallel_rank, "
        "get_data_parallel_world_size, get_data_parallel_rank, get_sequence_data_parallel_group, "
        "get_sequence_data_parallel_world_size, get_sequence_data_parallel_rank"
    )
    assert str(e.value).startswith(f"initialize(mpu=...): _MegatronMPU lacks {missing}; zero serves DeepSpeed's "
                                   "sequence-parallel mpu only")  # fmt: skip


def test_sequence_parallel_size_without_an_mpu_is_refused():
    with pytest.raises(zero.ConfigError, match="'sequence_parallel_size': 2 needs the sequence-parallel mpu"):
        parallel_groups(None, 2)
    assert parallel_groups(None, 1).shard_group is None and dist.is_available()
