"""The tuners on a synthetic space: grid covers everything, random is seeded, the model-based tuner reaches the
best in a third of the grid's trials, early stopping and num_trials end the search, failures never end it."""

import pytest

from zero.autotune.space import Candidate, enumerate_space, micro_batch_sizes, split_user_space, stages_to_tune
from zero.autotune.tuners import ModelBasedTuner, Search, make_tuner

KNOBS = {"overlap_comm": [True, False], "reduce_bucket_size": [1_000, 100_000, 10_000_000]}


def space() -> list[Candidate]:
    return [c for s in (1, 2, 3) for c in enumerate_space(s, [1, 2, 4, 8], KNOBS)]  # 72 candidates


def throughput(c: Candidate) -> float:
    """A smooth synthetic metric: best at stage 2, micro-batch 8, overlap on, the middle bucket size."""
    bucket = {1_000: 0.6, 100_000: 1.0, 10_000_000: 0.8}[c.knob("reduce_bucket_size")]
    stage = {1: 0.9, 2: 1.0, 3: 0.7}[c.stage]
    return 100 * stage * bucket * (1.1 if c.knob("overlap_comm") else 1.0) * (c.micro_batch / 8) ** 0.3


def test_grid_tries_every_candidate_once():
    cands = space()
    search = Search(make_tuner("gridsearch", cands), num_trials=1000, early_stopping=1000)
    order = search.run(throughput)
    assert sorted(order) == sorted(cands) and len(set(order)) == len(cands)
    assert search.stop_reason == "space exhausted"


def test_random_is_seeded_and_stops_at_num_trials():
    a = Search(make_tuner("random", space(), seed=3), 10, 1000).run(throughput)
    b = Search(make_tuner("random", space(), seed=3), 10, 1000).run(throughput)
    assert a == b and len(a) == 10 and len(set(a)) == 10


def test_model_based_finds_the_best_in_a_third_of_the_grid():
    cands = space()
    best = max(throughput(c) for c in cands)
    search = Search(ModelBasedTuner(cands, seed=0), num_trials=len(cands) // 3, early_stopping=8)
    order = search.run(throughput)
    assert len(order) <= len(cands) // 3
    assert max(throughput(c) for c in order) >= 0.95 * best, search.stop_reason


def test_early_stopping_after_trials_without_improvement():
    calls = []

    def flat(c):
        calls.append(c)
        return 1.0  # the first sets the best; no later one improves it

    search = Search(make_tuner("gridsearch", space()), num_trials=1000, early_stopping=3)
    assert len(search.run(flat)) == 4 and "tuner_early_stopping" in search.stop_reason


def test_failed_experiments_are_recorded_and_the_search_goes_on():
    def crashy(c):
        return None if c.stage == 1 else throughput(c)  # every stage-1 experiment "crashes"

    search = Search(make_tuner("gridsearch", space()), num_trials=1000, early_stopping=1000)
    order = search.run(crashy)
    assert len(order) == 72 and all(search.tried[c] is None for c in order if c.stage == 1)
    assert max(m for m in search.tried.values() if m is not None) == max(throughput(c) for c in space())


def test_user_lists_are_the_space_and_bad_input_is_named():
    base, lists = split_user_space({"zero_optimization": {"stage": [1, 3], "reduce_bucket_size": [5e7, 5e8]}})
    assert base["zero_optimization"] == {"stage": 1, "reduce_bucket_size": 5e7}
    assert stages_to_tune({}, lists) == [1, 3] and stages_to_tune({}, {}) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="zero_optimization.stage"):
        stages_to_tune({}, {"stage": [5]})
    with pytest.raises(ValueError, match="tuner_type"):
        make_tuner("bayes", space())
    assert micro_batch_sizes(12, 1, 3) == [3, 6, 12]
    cfg = Candidate(3, 4, (("overlap_comm", False),)).config({"train_batch_size": 64, "zero_optimization": {}})
    assert cfg == {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 3, "overlap_comm": False}}
