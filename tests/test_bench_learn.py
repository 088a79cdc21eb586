"""The learning benchmark's helpers: the signal of mixed groups, problem kinds, the transfer check."""

from __future__ import annotations

from bench.signal import _kind, mixed_fraction
from environments.problems import generate


def test_mixed_fraction_counts_groups_whose_first_k_rewards_differ():
    rewards = {"a": [1.0, 1.0, 0.0, 1.0], "b": [0.0, 0.0, 0.0, 0.0], "c": [0.0, 1.0], "d": [1.0]}
    assert mixed_fraction(rewards, 2) == (1, 1 / 3)  # a's first two agree, c's differ, d too short
    assert mixed_fraction(rewards, 4) == (1, 1 / 2)  # only a and b have four members
    assert mixed_fraction({}, 2) == (0, 0.0)


def test_a_problem_kind_names_its_suite_and_a_terminal_problem_its_operations():
    terminal = generate("terminal", 3, seed=20000, difficulty=2, length=1)
    for problem in terminal:
        operations = problem.meta["operations"]
        assert len(operations) == 2 and _kind(problem) == "terminal:" + "+".join(operations)
    assert {_kind(p) for p in generate("swe", 2, seed=20000, difficulty=1, length=1)} == {"swe"}


def test_transfer_scores_reference_solutions_and_pairs_them_by_problem(tmp_path):
    """bench.transfer: the same policy twice changes nothing; another policy changes the
    log-likelihood of every reference solution, and the seen set is the campaign's own problems."""
    import numpy as np

    from bench.transfer import paired, problem_sets, score
    from engines.model import ModelConfig, init_model
    from engines.model.loading import load_tokenizer
    from engines.train.sft import render
    from environments.demos import demonstration
    from environments.harness import TOOLS
    from tasks.problems import step_problems
    from tests.campaign_fixtures import tiny_campaign, tiny_policy

    before = tiny_policy(tmp_path / "a")
    after = str(tmp_path / "b")
    init_model(ModelConfig(preset="tiny", seed=1), after)
    config = tiny_campaign("t", before, str(tmp_path / "data"), steps=2)
    sets = problem_sets(config, 1, None)
    assert [p.problem_id for p in sets["seen"]] == [
        p["problem_id"] for step in range(2) for p in step_problems(config.problems, step)
    ]
    assert len(sets["unseen"]) == 1 and sets["unseen"][0].problem_id not in {
        p.problem_id for p in sets["seen"]
    }
    tokenizer = load_tokenizer(before)
    demos = [render(tokenizer, demonstration(p), TOOLS) for p in sets["seen"]]
    first, again, other = score(before, demos), score(before, demos), score(after, demos)
    assert np.array_equal(first, again) and (first[:, 0] < 0).all() and (first[:, 1] > 0).all()
    assert (first[:, 2] <= first[:, 1]).all()  # tokens not greedy are among the targets
    assert paired(again[:, 0] - first[:, 0])["mean"] == 0.0
    assert (other[:, 0] != first[:, 0]).all() and (other[:, 1] == first[:, 1]).all()
