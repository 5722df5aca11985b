"""Checkpoints written before the core's seam refactor still load.

``fixtures/v1_stage{1,3}`` were written by ``fixtures/make_v1_checkpoints.py`` with the zero_core of commit
aff49b6 on 2 ranks: 2 AdamW steps then a save; ``expected.safetensors`` holds that run's full parameters at the
save and after one more step. Loading into today's runtime must give the same parameters and, since the optimizer
state comes back too, the same next step.
"""

import sys
from pathlib import Path

import pytest
import torch

from zero_comm.testing import run_ranks

FIXTURES = Path(__file__).parent / "fixtures"
sys.path.insert(0, str(FIXTURES))


def _load_body(stage):
    import make_v1_checkpoints as v1

    from zero_core.checkpoint import load_checkpoint

    rt = v1.build(stage)
    load_checkpoint(rt, FIXTURES / f"v1_stage{stage}", "step2")
    before = rt.full_parameters()
    v1.train(rt, 1, 2)
    return before, rt.full_parameters(), int(rt.module.calls)


@pytest.mark.parametrize("stage", [1, 3])
def test_checkpoint_written_by_earlier_code_loads(stage):
    from safetensors.torch import load_file

    expected = load_file(str(FIXTURES / f"v1_stage{stage}" / "expected.safetensors"))
    for before, after, calls in run_ranks(_load_body, 2, stage, timeout=120):
        assert calls == 3  # the buffer came back (2 saved, plus the step after loading)
        for name, value in before.items():
            torch.testing.assert_close(value, expected[f"before/{name}"], rtol=0, atol=0)
        for name, value in after.items():
            torch.testing.assert_close(value, expected[f"after/{name}"], rtol=1e-6, atol=1e-7)
