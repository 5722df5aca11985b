"""The `quantization` section (subchannel FP8/INT8 Linear) wired by ``initialize()``: config errors name the key;
layer selection; on 2 gloo ranks every ZeRO stage and optimizer / parameter offload trains the quantized model as a
single process does (same quantized layers, each rank's micro-batches quantized as that rank sees them), and under
bf16 at stage 3 with offload the parameters, gradients, fp32 master weights and optimizer state have the dtypes
they have with the section off.

Tolerance of the 2-rank runs against the single-process run: the fp32 parity tests' (losses rtol 1e-6, parameters
atol 1e-6 / rtol 1e-5 after 3 AdamW steps; measured: losses within 5e-8, parameters within 3e-8). The runs differ
only in fp32 summation order (the cross-rank gradient average, the partitioned optimizer step); no quantized operand
element crossed a rounding boundary.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import zero
from zero.config import ConfigError, NotSupportedError, load_config
from zero.config.quantization_section import QuantizationSection
from zero.engine.param_access import safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state
from zero.engine.quantization import apply_quantization, select_linears
from zero_comm.testing import run_ranks
from zero_kernels import GemmQuant, SubchannelLinear

SECTION = {"enabled": True, "dtype": "fp8", "block_size": 16, "dx": {"dtype": "int8"},
           "exclude_module_name_patterns": ["head"]}  # fmt: skip
WORLD, GAS, STEPS, MICRO, LR, WD, CLIP = 2, 2, 3, 5, 1e-2, 0.1, 0.5
CASES = {
    "stage 0": {"stage": 0},
    "stage 1": {"stage": 1},
    "stage 2": {"stage": 2},
    "stage 3": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "stage 2, offload_optimizer cpu": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
    "stage 3, offload_optimizer + offload_param cpu": {"stage": 3, "stage3_param_persistence_threshold": 0,
                                                        "offload_optimizer": {"device": "cpu"},
                                                        "offload_param": {"device": "cpu"}},
}  # fmt: skip


class Net(nn.Module):
    """Linear(20, 36) -> GELU -> Linear(36, 36, no bias) -> GELU -> head Linear(36, 5): dimensions 16 does not
    divide, so every quantized GEMM has a short last block."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.body = nn.Sequential(nn.Linear(20, 36), nn.GELU(), nn.Linear(36, 36, bias=False), nn.GELU())
        self.head = nn.Linear(36, 5)

    def forward(self, x):
        return self.head(self.body(x))


def _batch(step: int, micro: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(MICRO, 20, generator=g), torch.randn(MICRO, 5, generator=g)


def _config(zero_section: dict) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "gradient_clipping": CLIP,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
            "zero_optimization": zero_section, "quantization": SECTION}  # fmt: skip


def single_process_run():
    """The quantized model trained in one process: each rank's micro-batch through its own forward and backward
    (so each dw GEMM quantizes that rank's tokens), gradients averaged, clipped, torch AdamW."""
    model = apply_quantization(Net(), QuantizationSection.model_validate(SECTION))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    losses = []
    for step in range(STEPS):
        for micro in range(GAS):
            per_rank = []
            for rank in range(WORLD):
                x, y = _batch(step, micro, rank)
                loss = F.mse_loss(model(x), y)
                (loss / (GAS * WORLD)).backward()
                per_rank.append(loss.item())
            losses.append(sum(per_rank) / WORLD)
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _dtypes_after_one_step(rank: int, section: dict | None) -> dict:
    """One bf16 step at stage 3 with optimizer and parameter offload: the dtype of each parameter, of its reduced
    gradient (before the step), fp32 master and AdamW moments (after it), and of the loss."""
    zero_section = {"stage": 3, "stage3_param_persistence_threshold": 0, "offload_optimizer": {"device": "cpu"},
                    "offload_param": {"device": "cpu"}}  # fmt: skip
    config = {**_config(zero_section), "gradient_accumulation_steps": 1, "bf16": {"enabled": True}}
    if section is None:
        del config["quantization"]
    engine, *_ = zero.initialize(model=Net(), config=config)
    x, y = _batch(0, 0, rank)
    loss = F.mse_loss(engine(x.bfloat16()), y.bfloat16())
    engine.backward(loss)
    params = list(engine.module.named_parameters())
    out = {"loss": loss.dtype, "grads": {n: safe_get_full_grad(p).dtype for n, p in params}}
    engine.step()
    out["params"] = {n: p.dtype for n, p in params}
    out["master"] = {n: safe_get_full_fp32_param(p).dtype for n, p in params}
    for key in ("exp_avg", "exp_avg_sq"):
        out[key] = {n: safe_get_full_optimizer_state(p, key).dtype for n, p in params}
    out["quantized"] = sorted(n for n, m in engine.module.named_modules() if isinstance(m, SubchannelLinear))
    engine.destroy()
    return out


def ranks_body():
    rank = torch.distributed.get_rank()
    out = {"dtypes": {"off": _dtypes_after_one_step(rank, None), "on": _dtypes_after_one_step(rank, SECTION)}}
    for label, zero_section in CASES.items():
        engine, *_ = zero.initialize(model=Net(), config=_config(zero_section))
        kinds = {n: type(m).__name__ for n, m in engine.module.named_modules() if isinstance(m, nn.Linear)}
        keys = sorted(engine.module.state_dict())
        losses = []
        for step in range(STEPS):
            for micro in range(GAS):
                x, y = _batch(step, micro, rank)
                loss = F.mse_loss(engine(x), y)
                engine.backward(loss)
                engine.step()
                t = torch.tensor([loss.item()], dtype=torch.float64)
                torch.distributed.all_reduce(t)
                losses.append(t.item() / WORLD)
        out[label] = {"losses": losses, "params": engine.runtime.full_parameters(), "kinds": kinds, "keys": keys}
        engine.destroy()
    with pytest.raises(ConfigError, match="module_name_patterns.*'body.9'"):  # on every rank, before any build
        bad = {**_config({"stage": 3}), "quantization": {**SECTION, "module_name_patterns": ["body.9"]}}
        zero.initialize(model=Net(), config=bad)
    return out


def test_stages_and_offload_train_as_one_process():
    results = run_ranks(ranks_body, WORLD, timeout=240, threads=1)
    ref_losses, ref_params = single_process_run()
    plain_keys = sorted(Net().state_dict())
    for rank, res in enumerate(results):
        on, off = res["dtypes"]["on"], res["dtypes"]["off"]
        assert on.pop("quantized") == ["body.0", "body.2"] and off.pop("quantized") == []
        assert on == off and on["loss"] == torch.bfloat16, f"rank {rank}"
        assert set(on["params"].values()) == {torch.bfloat16} and set(on["master"].values()) == {torch.float32}
        assert set(on["exp_avg"].values()) == set(on["exp_avg_sq"].values()) == {torch.float32}
    for label in CASES:
        for rank, res in enumerate(results):
            got = res[label]
            assert got["kinds"] == {"body.0": "SubchannelLinear", "body.2": "SubchannelLinear", "head": "Linear"}
            assert got["keys"] == plain_keys, label
            for step, (a, b) in enumerate(zip(got["losses"], ref_losses)):
                assert math.isclose(a, b, rel_tol=1e-6), f"{label}, rank {rank}: micro-step {step} {a} vs {b}"
            for name, want in ref_params.items():
                torch.testing.assert_close(got["params"][name], want, atol=1e-6, rtol=1e-5, msg=f"{label}: {name}")


def test_config_section_defaults_recipe_and_errors():
    cfg = load_config({"train_batch_size": 2})
    assert cfg.quantization.enabled is False and cfg.quantization.dtype == "fp8"
    assert cfg.quantization.block_size == 128 and cfg.quantization.module_name_patterns == ["*"]
    recipe = QuantizationSection.model_validate({**SECTION, "dw": {"enabled": False}, "forward": {"block_size": 0}})
    r = recipe.recipe()
    assert (r.forward, r.dx, r.dw) == (GemmQuant("fp8", 0), GemmQuant("int8", 16), None)
    base = {"train_batch_size": 2}
    for section, message in (
        ({"enabled": True, "blok_size": 0}, r"quantization\.blok_size.*block_size"),
        ({"dx": {"dtyp": "int8"}}, r"quantization\.dx\.dtyp.*dtype"),
        ({"dtype": "fp4"}, r"quantization\.dtype.*fp4"),
        ({"block_size": -1}, r"quantization\.block_size"),
        ({"forward": {"block_size": 1.5}}, r"quantization\.forward\.block_size"),
        ({"block_size": True}, r"quantization\.block_size"),
        ({"dw": {"enabled": "sometimes"}}, r"quantization\.dw\.enabled"),
        ({"module_name_patterns": "body.*"}, r"quantization\.module_name_patterns.*valid list"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_config({**base, "quantization": section})
    with pytest.raises(NotSupportedError, match="quantization.enabled.*tensor_parallel.autotp_size"):
        load_config({**base, "quantization": {"enabled": True}, "tensor_parallel": {"autotp_size": 2}}, 2)
    with pytest.raises(NotSupportedError, match="quantization.enabled.*compile.deepcompile"):
        load_config({**base, "quantization": {"enabled": True}, "compile": {"deepcompile": True},
                     "zero_optimization": {"stage": 3}})  # fmt: skip


def test_layer_selection():
    section = QuantizationSection.model_validate({"enabled": True, "module_name_patterns": ["body.*"]})
    model = Net()
    assert select_linears(model, section) == ["body.0", "body.2"]
    weight = model.body[0].weight
    assert apply_quantization(model, section) is model and model.body[0].weight is weight
    assert isinstance(model.body[0], SubchannelLinear) and type(model.head) is nn.Linear
    assert apply_quantization(model, section) is model  # already swapped: left as is
    for excluded, message in ((["tail"], "exclude_module_name_patterns.*'tail'"), (["*"], "select no torch.nn.Linear")):
        with pytest.raises(ConfigError, match=message):
            select_linears(Net(), QuantizationSection(enabled=True, exclude_module_name_patterns=excluded))
    root = nn.Linear(4, 3)
    swapped = apply_quantization(root, QuantizationSection(enabled=True))
    assert isinstance(swapped, SubchannelLinear) and swapped.weight is root.weight
    assert apply_quantization(root, QuantizationSection()) is root  # off: nothing happens


def test_zero_train_flags_are_checked_before_any_run(tmp_path, capsys):
    """``zero train --quantization fp8|int8 [--quantization-block-size N]`` fills the section; a bad value fails
    before the run folder exists, naming the flag or the config key."""
    from zero.cli import main
    from zero.commands.train import DEFAULT_CONFIG, _apply_quantization

    runs = str(tmp_path / "runs")
    assert main(["train", "--runs-dir", runs, "--quantization-block-size", "0"]) == 2
    assert "--quantization-block-size needs --quantization" in capsys.readouterr().err
    assert main(["train", "--runs-dir", runs, "--quantization", "int8", "--quantization-block-size", "-1"]) == 2
    assert "'quantization.block_size': got -1" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()
    config = _apply_quantization(DEFAULT_CONFIG, "int8", 0)
    assert config["quantization"] == {"enabled": True, "dtype": "int8", "block_size": 0}
    assert "quantization" not in DEFAULT_CONFIG and _apply_quantization(DEFAULT_CONFIG, None, None) is DEFAULT_CONFIG
