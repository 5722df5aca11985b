"""``expert_parallel``: AutoEP, DeepSpeed 0.19.8's section that makes a Hugging Face MoE model expert-parallel at
``initialize()`` (``deepspeed.module_inject.auto_ep_config``). The conversion: :mod:`zero.engine.autoep`."""

from __future__ import annotations

from typing import Literal

import pydantic
from pydantic import PositiveInt


class ExpertParallelSection(pydantic.BaseModel):
    """``expert_parallel`` (DeepSpeed's keys and defaults).

    Attributes:
        enabled: replace the model's MoE blocks at initialize() (False: the section is ignored).
        autoep_size: ranks of an expert-parallel group; must divide the world size and every block's expert count.
        preset_model: "mixtral" or "qwen3_moe" (None: Mixtral's layout, ``model.layers.<i>.mlp``).
        moe_layer_pattern: regular expression matched in full against MoE blocks' dotted names (overrides the
            preset's).
        router_pattern, expert_pattern: the block's router and experts child names (override the preset's).
        top_k: "auto" (the model's ``num_experts_per_tok``) or the routes per token.
        load_balance_coeff: null only (DeepSpeed 0.19.8 refuses a value: auxiliary-loss-free balancing).
        use_grouped_mm: accepted; the local experts run one matmul pair each (the result is the same).
        expert_tensor_parallel_size: 1 only (experts are whole on each rank).
        score_func: "auto" or "softmax" (the router's own; "sigmoid" is refused).
        route_scale: 1.0 only (the model's weights are used as the router gives them).
    """

    model_config = pydantic.ConfigDict(extra="forbid")
    enabled: bool = False
    autoep_size: PositiveInt = 1
    preset_model: Literal["mixtral", "qwen3_moe"] | None = None
    moe_layer_pattern: str | None = None
    router_pattern: str | None = None
    expert_pattern: str | None = None
    top_k: PositiveInt | Literal["auto"] = "auto"
    load_balance_coeff: None = None
    use_grouped_mm: bool = True
    expert_tensor_parallel_size: Literal[1] = 1
    score_func: Literal["auto", "softmax"] = "auto"
    route_scale: Literal[1.0] = 1.0

    @pydantic.field_validator("load_balance_coeff", mode="before")
    @classmethod
    def _no_coeff(cls, value):
        if value is not None:
            raise ValueError(f"load_balance_coeff={value!r} is not supported (DeepSpeed 0.19.8's AutoEP refuses it "
                             "too: auxiliary-loss-free load balancing); set it to null or omit the key")  # fmt: skip
        return value
