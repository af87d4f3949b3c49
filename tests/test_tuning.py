"""``pl-dp tune``: a random number of trials, only the best released, resumable, one privacy event repeated."""

import json
import math
import os
from pathlib import Path

import pytest
import torch
from scipy import stats

from pl_dp.cli import main
from pl_dp.errors import ConfigError, PrivacyConfigError
from pl_dp.privacy.report import PrivacyReport
from pl_dp.privacy.selection import SecretCoin, TrialCount, search_epsilon
from pl_dp.tuning import (
    RELEASED_FILE,
    STATE_FILE,
    Search,
    SearchSpace,
    TrialResult,
    lightning_trial,
    planned_event,
)

ROOT = Path(__file__).resolve().parents[1]
HISTORY = [[1.2, 0.05, 40]]
DELTA = 1e-5
SPACE = SearchSpace.parse(["model.init_args.lr=[0.1,0.2,0.3]"])


class RecordedTrial:
    """A trial that releases ``HISTORY`` (as a privacy state its checkpoint holds) and scores its learning rate,
    without training: the search's own logic under test, many times over. ``interrupt_at``: the call that is
    killed (KeyboardInterrupt, as Ctrl-C) before it finishes."""

    def __init__(self, history=HISTORY, interrupt_at=None, histories=None):
        self.history, self.interrupt_at, self.histories = history, interrupt_at, histories
        self.calls = []

    def __call__(self, candidate, directory):
        self.calls.append((directory.name, dict(candidate)))
        if len(self.calls) == self.interrupt_at:
            raise KeyboardInterrupt
        history = self.histories[len(self.calls) - 1] if self.histories else self.history
        directory.mkdir(parents=True)
        path = directory / "trial.ckpt"
        state = {"method": "DPSGD", "privacy": {"epsilon": 1.0}, "accountant": {"mechanism": "rdp", "history": history}}
        torch.save({"pl_dp": state | {"delta": DELTA}}, path)
        score = candidate["model.init_args.lr"]
        return TrialResult(score=score, history=history, accountant="rdp", delta=DELTA, checkpoint=str(path))


def _search(directory, count, seed, space=SPACE):
    return Search(directory=directory, space=space, count=count, coin=SecretCoin(seed=seed), progress=False)


def test_the_search_draws_its_number_of_trials(tmp_path):
    """Over 600 searches (fixed seeds) the number of trials run follows the geometric distribution asked for; a search
    that ran a fixed number of trials (the mean) fails this."""
    count = TrialCount(mean=2.0, shape=1.0)
    runs = []
    for seed in range(600):
        trial = RecordedTrial()
        _search(tmp_path / str(seed), count, seed).run(trial)
        runs.append(len(trial.calls))
    cells = [1, 2, 3, 4]
    observed = [runs.count(k) for k in cells] + [sum(k > cells[-1] for k in runs)]
    expected = [len(runs) * count.probability(k) for k in cells]
    expected.append(len(runs) - sum(expected))
    assert stats.chisquare(observed, expected).pvalue > 1e-3, observed


def test_only_the_best_is_released_and_nothing_shows_how_many_trials_ran(tmp_path):
    count = TrialCount(mean=6.0, shape=1.0)
    trial = RecordedTrial()
    released = _search(tmp_path, count, seed=3).run(trial)
    assert len(trial.calls) > 1  # this seed runs several trials
    best = max(candidate["model.init_args.lr"] for _, candidate in trial.calls)
    assert released.checkpoint == tmp_path / RELEASED_FILE and released.score == best
    state = json.loads((tmp_path / STATE_FILE).read_text())
    assert state["trials"] == [] and state["released"]["candidate"] == {"model.init_args.lr": best}
    assert sorted(path.name for path in tmp_path.iterdir()) == [RELEASED_FILE, STATE_FILE]  # no trials/ folder
    checkpoint = torch.load(released.checkpoint, weights_only=False)
    assert checkpoint["pl_dp"]["search"]["candidate"] == {"model.init_args.lr": best}
    assert released.report.epsilon == pytest.approx(search_epsilon(HISTORY, count, DELTA), rel=1e-12)
    assert "number of trials" in released.report.user_seeded  # the test seeded the draws, and the report says so


def test_a_killed_search_resumes_without_rerunning_or_redrawing(tmp_path):
    """Killed inside its second trial, a search resumes without running that trial again (it counts as one of the K,
    lost) nor the first; its release reports the same ε as the search's bound."""
    count = TrialCount(mean=4.0, shape=1.0)
    killed = RecordedTrial(interrupt_at=2)
    with pytest.raises(KeyboardInterrupt):
        _search(tmp_path, count, seed=0).run(killed)
    first, second = killed.calls
    finished = tmp_path / "trials" / first[0] / "trial.ckpt"
    written = os.stat(finished).st_mtime_ns
    resumed = RecordedTrial()
    released = _search(tmp_path, count, seed=1).run(resumed)
    assert {first[0], second[0]}.isdisjoint(name for name, _ in resumed.calls)
    if finished.exists():
        assert os.stat(finished).st_mtime_ns == written
    if released.checkpoint is not None:
        assert released.report.epsilon == pytest.approx(search_epsilon(HISTORY, count, DELTA), rel=1e-12)
    again = RecordedTrial()
    assert _search(tmp_path, count, seed=2).run(again) == released and not again.calls  # a finished search stays so


def test_killing_trials_never_runs_more_than_the_drawn_number_of_trials(tmp_path):
    """A user who kills trials (here half of them, at random) and resumes each time runs, over 400 searches, a number
    of trials that follows the geometric distribution of K: a kill loses a trial, it never re-rolls one. Re-running
    the killed trial with fresh noise (found by review) runs about twice as many."""
    count = TrialCount(mean=2.0, shape=1.0)
    looks = SecretCoin(seed=12345)
    runs = []
    for seed in range(400):

        def watched(candidate, directory, calls=[]):  # noqa: B006 (counts this search's runs)
            calls.append(directory.name)
            if looks.uniform() < 0.5:
                raise KeyboardInterrupt
            return RecordedTrial()(candidate, directory)

        for attempt in range(50):
            try:
                released = _search(tmp_path / str(seed), count, seed * 100 + attempt).run(watched)
                break
            except KeyboardInterrupt:
                continue
        runs.append(len(watched.__defaults__[0]))
        if released.checkpoint is None:
            assert released.interrupted and "interrupted" in str(released)
    cells = [1, 2, 3, 4]
    observed = [runs.count(k) for k in cells] + [sum(k > cells[-1] for k in runs)]
    expected = [len(runs) * count.probability(k) for k in cells]
    expected.append(len(runs) - sum(expected))
    assert stats.chisquare(observed, expected).pvalue > 1e-3, observed


def test_a_poisson_search_may_draw_no_trial_and_then_releases_nothing(tmp_path):
    trial = RecordedTrial()
    released = _search(tmp_path, TrialCount(mean=1.2, shape=math.inf), seed=0).run(trial)  # seed 0 draws K = 0
    assert not trial.calls and released.checkpoint is None and released.report is None
    assert "nothing is released" in str(released) and not (tmp_path / RELEASED_FILE).exists()


def test_a_trial_with_another_privacy_event_stops_the_search_and_releases_nothing(tmp_path):
    trial = RecordedTrial(histories=[HISTORY, [[1.2, 0.05, 41]]] + [HISTORY] * 50)
    with pytest.raises(PrivacyConfigError, match="not one mechanism repeated") as refused:
        _search(tmp_path, TrialCount(mean=50.0, shape=1.0), seed=0).run(trial)
    assert not (tmp_path / RELEASED_FILE).exists()
    message = str(refused.value).replace(str(tmp_path), "<tmp>")  # pytest's folder names hold numbers of their own
    assert "41" not in message  # a later trial's event is never printed


@pytest.mark.slow
def test_a_trial_that_stops_early_is_accounted_by_its_plan(tmp_path, capsys):
    """EarlyStopping (a stop that depends on the model) ends a trial after one of its two planned epochs: the trial is
    accounted by its plan fixed at fit start — the search neither refuses it nor stores its actual step count — and
    the release's ``search.history`` is the planned event. Comparing actual histories (found by review) made a
    data-dependent exit and message, and stored the first trial's actual history."""
    import yaml

    config = yaml.safe_load(_tiny("tune_dpsgd.yaml", tmp_path, max_epochs=2).read_text())
    early = {"monitor": "val/acc", "mode": "max", "stopping_threshold": 0.0}  # stops at the first validation
    config["trainer"]["callbacks"].append(
        {"class_path": "lightning.pytorch.callbacks.EarlyStopping", "init_args": early}
    )
    path = tmp_path / "early.yaml"
    path.write_text(yaml.safe_dump(config))
    result = lightning_trial(path, [], "val/acc", progress=False)({"model.init_args.lr": 0.5}, tmp_path / "trial")
    state = torch.load(result.checkpoint, weights_only=False)["pl_dp"]
    (sigma, rate, steps), actual = result.history[0], state["accountant"]["history"]
    assert len(result.history) == 1 and steps == state["planned_steps"]
    assert 0 < state["private_steps"] < steps and actual[0][:2] == [sigma, rate]  # it stopped early
    directory = tmp_path / "search"
    space = "model.init_args.lr=[0.5]"
    main(
        ["tune", "--config", str(path), "--tune.space", space, "--tune.mean", "1.5", "--tune.directory", str(directory)]
    )
    search = torch.load(directory / RELEASED_FILE, weights_only=False)["pl_dp"]["search"]
    assert search["history"] == result.history
    report = PrivacyReport.from_checkpoint(directory / RELEASED_FILE)
    assert "trained on" not in str(report)  # the released trial's own early stop is no training after the search
    assert report.epsilon == pytest.approx(
        search_epsilon(result.history, TrialCount(mean=1.5, shape=1.0), result.delta)
    )
    capsys.readouterr()


def test_a_trial_is_accounted_by_its_plan_and_refused_beyond_it():
    state = {"noise_multiplier": 1.2, "sample_rate": 0.05, "planned_steps": 40, "accountant": {"history": HISTORY}}
    assert planned_event(state) == [[1.2, 0.05, 40]]
    assert planned_event(state | {"accountant": {"history": [[1.2, 0.05, 7]]}}) == [[1.2, 0.05, 40]]  # stopped early
    for history in ([[1.2, 0.05, 47]], [[1.3, 0.05, 7]], [[1.2, 0.05, 30], [1.2, 0.06, 7]]):
        with pytest.raises(PrivacyConfigError, match="do not fit the plan") as refused:
            planned_event(state | {"accountant": {"history": history}})
        assert "47" not in str(refused.value) and " 7" not in str(refused.value)
    banded = state | {"bands": 4, "accountant": {"history": [[1.2, 0.05, 10]]}}  # 40 steps: ⌈40/4⌉ compositions
    assert planned_event(banded) == [[1.2, 0.05, 10]]
    with pytest.raises(PrivacyConfigError, match="do not fit the plan"):
        planned_event(banded | {"accountant": {"history": [[1.2, 0.05, 11]]}})


@pytest.mark.parametrize(
    "entry",
    [
        "data.init_args.batch_size=[32,64]",
        "trainer.max_epochs=[5,10]",
        "model.init_args.privacy.epsilon=[1,2]",
        "model.init_args.privacy=[{epsilon: 1}]",
        "model.init_args.noise_seed=[1,2]",
        "seed_everything=[0,1]",
    ],
)
def test_a_space_that_changes_the_privacy_event_is_refused(entry):
    with pytest.raises(PrivacyConfigError, match="same privacy event"):
        SearchSpace.parse([entry])


def test_a_space_of_method_and_optimizer_hyperparameters_is_a_grid():
    space = SearchSpace.parse(["model.init_args.lr=[0.1,0.2]", "model.init_args.clip=[1, 2, 4]", "optimizer.x=[1]"])
    assert len(space.candidates()) == 6
    with pytest.raises(ConfigError, match="KEY="):
        SearchSpace.parse(["model.init_args.lr=0.1"])


def test_another_search_in_the_same_directory_is_refused(tmp_path):
    _search(tmp_path, TrialCount(mean=2.0, shape=1.0), seed=0).run(RecordedTrial())
    with pytest.raises(ConfigError, match="different search"):
        _search(tmp_path, TrialCount(mean=3.0, shape=1.0), seed=0).run(RecordedTrial())


def _tiny(name, tmp_path, **trainer):
    import yaml

    config = yaml.safe_load((ROOT / "configs/digits" / name).read_text())
    config["trainer"].update(enable_progress_bar=False, **trainer)
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.slow
def test_pl_dp_tune_on_digits_releases_one_checkpoint_and_its_report(tmp_path, capsys):
    """The command line on DP-SGD, three steps per trial: one checkpoint and the search's report, which
    ``pl-dp report`` gives again from the checkpoint."""
    config = _tiny("tune_dpsgd.yaml", tmp_path, max_steps=3)
    directory = tmp_path / "search"
    space = "model.init_args.lr=[0.1,0.5]"
    args = ["--config", str(config), "--tune.space", space, "--tune.mean", "1.5", "--tune.directory", str(directory)]
    main(["tune", *args])
    out = capsys.readouterr().out
    assert f"pl-dp tune: released {directory / RELEASED_FILE}" in out
    assert "pl_dp privacy report — DPSGD" in out and "RepeatAndSelectDpEvent" in out
    assert sorted(path.name for path in directory.rglob("*")) == ["best.ckpt", "search.json"]  # no trial's files
    report = PrivacyReport.from_checkpoint(directory / RELEASED_FILE)
    state = json.loads((directory / STATE_FILE).read_text())["event"]
    assert report.epsilon == pytest.approx(
        search_epsilon(state["history"], TrialCount(mean=1.5, shape=1.0), state["delta"])
    )
    assert report.trial_epsilon < report.epsilon <= 3.0  # per-trial target 1; a mean of 1.5 trials costs ~2
    guarantee = str(report).splitlines()[1]
    main(["report", str(directory / RELEASED_FILE)])
    assert guarantee in capsys.readouterr().out
    main(["test", "--config", str(config), "--ckpt_path", str(directory / RELEASED_FILE)])
    assert guarantee in capsys.readouterr().out  # the model restored from the release reports the search's epsilon
    with pytest.raises(SystemExit) as refused:  # training the release further would leave the search's cost out
        main(["fit", "--config", str(config), "--ckpt_path", str(directory / RELEASED_FILE), "--trainer.max_steps=6"])
    assert refused.value.code == 2 and "release of a hyperparameter search" in capsys.readouterr().err
    with pytest.raises(SystemExit) as refused:
        main(["tune", *args[:2], "--tune.space", "data.init_args.batch_size=[8]", *args[4:]])
    assert refused.value.code == 2 and "same privacy event" in capsys.readouterr().err


@pytest.mark.slow
def test_a_dpzero_search_stopped_after_one_trial_resumes_without_rerunning_it(tmp_path):
    """DPZero trials of three steps, the real Lightning trial: a search capped at one trial stops resumable; the
    resumed search never runs that trial again, and reports the bound of the whole search."""
    config = _tiny("tune_dpzero.yaml", tmp_path, max_steps=3)
    runner = lightning_trial(config, [], "val/acc", progress=False)
    calls = []

    def counted(candidate, directory):
        calls.append(directory.name)
        return runner(candidate, directory)

    count = TrialCount(mean=2.0, shape=1.0)
    space = SearchSpace.parse(["model.init_args.lr=[0.01,0.02]"])
    # seed 1 draws two trials: the cap stops the search after the first
    assert _search(tmp_path / "search", count, seed=1, space=space).run(counted, max_trials=1) is None
    assert len(calls) == 1
    released = _search(tmp_path / "search", count, seed=6, space=space).run(counted)
    assert released is not None and len(set(calls)) == len(calls)
    event = json.loads((tmp_path / "search" / STATE_FILE).read_text())["event"]
    assert event["accountant"] == "prv" and event["history"][0][2] == 3
    assert released.report.epsilon == pytest.approx(search_epsilon(event["history"], count, event["delta"]))
