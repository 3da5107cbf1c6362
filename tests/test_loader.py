"""``MicrobatchingDataLoader``: the plain loader's batches, tagged; workers; state; resume."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, SequentialSampler, TensorDataset
from torchdata.stateful_dataloader import StatefulDataLoader

import elastic_batches as eb
from elastic_batches.testing import inject_oom

SCRIPTS = Path(__file__).parent / "scripts"


def _dataset(rows: int = 20) -> TensorDataset:
    return TensorDataset(torch.arange(rows * 3, dtype=torch.float32).view(rows, 3), torch.arange(rows))


def _rows(batch: eb.ElasticBatch) -> list[int]:
    """The sample indices a batch holds (second field of the TensorDataset)."""
    return batch.unwrap()[1].tolist()


def _assert_same_batches(elastic: list[eb.ElasticBatch], plain: list[Any]) -> None:
    assert len(elastic) == len(plain)
    for got, expected in zip(elastic, plain, strict=True):
        unwrapped = got.unwrap()
        assert type(unwrapped) is type(expected)
        for a, b in zip(unwrapped, expected, strict=True):
            assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# The same batches as the plain loader


@pytest.mark.parametrize(
    ("kwargs", "length"),
    [
        ({"batch_size": 8}, 3),
        ({"batch_size": 8, "drop_last": True}, 2),
        ({"batch_size": 20}, 1),
        ({"batch_size": 1}, 20),
    ],
    ids=["uneven-last", "drop-last", "one-batch", "batch-1"],
)
def test_len_is_the_plain_loaders(kwargs: dict[str, Any], length: int) -> None:
    loader = eb.MicrobatchingDataLoader(_dataset(), **kwargs)
    assert len(loader) == len(DataLoader(_dataset(), **kwargs)) == length == len(list(loader))


@pytest.mark.parametrize("cls", [DataLoader, StatefulDataLoader], ids=["DataLoader", "StatefulDataLoader"])
def test_wraps_a_loader_and_leaves_it_untouched(cls: type[DataLoader]) -> None:
    plain = cls(_dataset(), batch_size=6, shuffle=False, drop_last=False)
    attributes = {k: getattr(plain, k) for k in ("collate_fn", "batch_sampler", "sampler", "batch_size", "dataset")}
    loader = eb.MicrobatchingDataLoader(plain)
    batches = list(loader)
    assert all(isinstance(b, eb.ElasticBatch) for b in batches)
    _assert_same_batches(batches, list(plain))
    assert {k: getattr(plain, k) for k in attributes} == attributes
    assert type(next(iter(plain))) is list  # the original still yields the plain structure
    assert isinstance(loader, StatefulDataLoader) and loader.batch_size == 6


@pytest.mark.parametrize("shuffle", [False, True], ids=["in-order", "shuffled"])
def test_builds_from_dataset_arguments_as_a_stateful_dataloader(shuffle: bool) -> None:
    def generator() -> torch.Generator:
        return torch.Generator().manual_seed(7)

    plain = StatefulDataLoader(_dataset(), batch_size=4, shuffle=shuffle, generator=generator())
    loader = eb.MicrobatchingDataLoader(_dataset(), batch_size=4, shuffle=shuffle, generator=generator())
    _assert_same_batches(list(loader), list(plain))


def test_wrapping_a_shuffled_dataloader_keeps_its_sampler() -> None:
    plain = DataLoader(_dataset(), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(7))
    loader = eb.MicrobatchingDataLoader(plain)
    assert loader.sampler is plain.sampler
    order = [_rows(b) for b in loader]
    plain.generator.manual_seed(7)
    assert order == [b[1].tolist() for b in plain]


def test_keyword_overrides_when_wrapping() -> None:
    plain = DataLoader(_dataset(), batch_size=6)
    shuffled = eb.MicrobatchingDataLoader(plain, batch_size=5, shuffle=True, generator=torch.Generator().manual_seed(0))
    rows = [_rows(b) for b in shuffled]
    assert [len(r) for r in rows] == [5, 5, 5, 5]
    assert sorted(sum(rows, [])) == list(range(20)) and sum(rows, []) != list(range(20))


def test_custom_collate_fn_and_structures_survive() -> None:
    samples = [{"x": torch.full((2,), float(i)), "text": f"t{i}"} for i in range(6)]

    def collate(batch: list[dict[str, Any]]) -> dict[str, Any]:
        return {"x": torch.stack([s["x"] for s in batch]), "text": [s["text"] for s in batch], "lr": 0.1}

    loader = eb.MicrobatchingDataLoader(DataLoader(samples, batch_size=4, collate_fn=collate))
    first = next(iter(loader))
    assert [mb.unwrap()["text"] for mb in first.microbatches(2)] == [["t0", "t1"], ["t2", "t3"]]
    assert first.unwrap()["lr"] == 0.1


def test_default_collate_of_dict_samples_with_strings() -> None:
    samples = [{"x": torch.full((2,), float(i)), "text": f"t{i}", "label": i} for i in range(5)]
    batch = next(iter(eb.MicrobatchingDataLoader(samples, batch_size=5)))
    assert [mb.unwrap()["text"] for mb in batch.microbatches(2)] == [["t0", "t1", "t2"], ["t3", "t4"]]
    assert batch.unwrap()["label"].tolist() == list(range(5))


def test_custom_batch_sampler() -> None:
    sampler = BatchSampler(SequentialSampler(range(10)), batch_size=3, drop_last=False)
    plain = DataLoader(_dataset(10), batch_sampler=sampler)
    loader = eb.MicrobatchingDataLoader(plain)
    assert [_rows(b) for b in loader] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9]]
    assert len(loader) == 4


class _Batches(IterableDataset):
    """Yields whole batches (used with ``batch_size=None``) or single samples."""

    def __init__(self, whole: bool) -> None:
        self.whole = whole

    def __iter__(self) -> Any:
        for start in range(0, 9, 3):
            if self.whole:
                yield {"x": torch.arange(start, start + 3)}
            else:
                yield from ({"x": torch.tensor(i)} for i in range(start, start + 3))


@pytest.mark.parametrize(("whole", "batch_size"), [(True, None), (False, 4)], ids=["batch-size-none", "iterable"])
def test_iterable_datasets_and_whole_batches(whole: bool, batch_size: int | None) -> None:
    loader = eb.MicrobatchingDataLoader(_Batches(whole), batch_size=batch_size)
    got = [b.unwrap()["x"].tolist() for b in loader]
    assert got == ([[0, 1, 2], [3, 4, 5], [6, 7, 8]] if whole else [[0, 1, 2, 3], [4, 5, 6, 7], [8]])


def test_wrapping_a_microbatching_loader_shares_its_controller() -> None:
    inner = eb.MicrobatchingDataLoader(_dataset(), batch_size=4, controller=eb.SplitController(split_count=2))
    outer = eb.MicrobatchingDataLoader(inner, batch_size=5)
    assert outer.controller is inner.controller
    assert [len(b) for b in outer] == [5, 5, 5, 5] and next(iter(outer)).split_count == 2


def test_pin_memory_is_dropped_without_an_accelerator() -> None:
    if torch.accelerator.is_available():
        pytest.skip("this machine has an accelerator: pinning is kept")  # pragma: no cover
    loader = eb.MicrobatchingDataLoader(_dataset(), batch_size=4, pin_memory=True)
    assert loader.pin_memory is False and len(list(loader)) == 5


# ---------------------------------------------------------------------------------------------
# Workers


def test_workers_with_persistent_workers_over_two_epochs() -> None:
    loader = eb.MicrobatchingDataLoader(_dataset(), batch_size=4, num_workers=2, persistent_workers=True)
    first, second = [_rows(b) for b in loader], [_rows(b) for b in loader]
    assert first == second == [list(range(i, min(i + 4, 20))) for i in range(0, 20, 4)]


def test_spawn_workers_receive_registrations_made_in_main() -> None:
    """A script run as ``__main__`` registers a batch type and a collate function; spawn workers use both."""
    result = subprocess.run(
        [sys.executable, str(SCRIPTS / "spawn_registration.py")], capture_output=True, text=True, timeout=240
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    expected_rows = [[i, i + 1] for i in range(0, 12, 2)]
    for epoch in report["epochs"]:
        assert epoch["rows"] == expected_rows and epoch["types"] == ["Pair"]
        assert len(epoch["pids"]) == 2 and report["main_pid"] not in epoch["pids"]  # collated in two workers
    assert report["epochs"][0]["pids"] == report["epochs"][1]["pids"]  # persistent workers


# ---------------------------------------------------------------------------------------------
# Tags


def test_tags_are_set_when_a_batch_is_yielded_even_if_prefetched() -> None:
    controller = eb.SplitController()
    loader = eb.MicrobatchingDataLoader(
        _dataset(24), batch_size=4, num_workers=2, prefetch_factor=4, controller=controller
    )
    iterator = iter(loader)
    assert next(iterator).split_count == 1
    controller.record_oom(4, 4)  # the step side learns: 2 microbatches of 2, while workers hold prefetched batches
    assert [b.split_count for b in iterator] == [2] * 5


def test_a_tag_is_the_count_of_the_moment_the_batch_was_yielded() -> None:
    """The count is worked out when first read, from what the controller had settled on at the yield."""
    controller = eb.SplitController()
    iterator = iter(eb.MicrobatchingDataLoader(_dataset(24), batch_size=4, controller=controller))
    next(iterator)
    held = next(iterator)  # not read yet
    controller.record_oom(4, 4)
    after = next(iterator)
    controller.record_oom(2, 4)  # learned after both were yielded
    assert (held.split_count, after.split_count, controller.count_for(4)) == (1, 2, 4)


def test_a_tokens_controller_needs_padded_batches_from_the_first_one() -> None:
    loader = eb.MicrobatchingDataLoader(_dataset(8), batch_size=4, controller=eb.SplitController(unit="tokens"))
    with pytest.raises(ValueError, match="a tokens-based split needs a batch with padded fields"):
        next(iter(loader))


def test_tags_follow_each_batchs_size() -> None:
    controller = eb.SplitController()
    controller.record_oom(8, 8)
    controller.record_success(4, 8)
    loader = eb.MicrobatchingDataLoader(_dataset(19), batch_size=8, controller=controller)
    assert [(len(b), b.split_count) for b in loader] == [(8, 2), (8, 2), (3, 1)]


# ---------------------------------------------------------------------------------------------
# State


def _loader(controller: eb.SplitController | None = None, **kwargs: Any) -> eb.MicrobatchingDataLoader:
    # Shuffled from the global seed: torchdata does not save the state of a generator= passed by the user,
    # so with one only the epoch in progress resumes identically, not the ones after it.
    torch.manual_seed(3)
    return eb.MicrobatchingDataLoader(_dataset(16), controller=controller, batch_size=3, shuffle=True, **kwargs)


@pytest.mark.parametrize("num_workers", [0, 2], ids=["in-process", "two-workers"])
def test_state_round_trip_contract(num_workers: int) -> None:
    """After torchdata's ``run_test_save_load_state``: stop after any batch of two epochs, resume identically.

    The resumed loader yields exactly the rest of the epoch it was saved in, then the same next epoch.
    """
    reference = _loader(num_workers=num_workers)
    epochs = [[_rows(b) for b in reference] for _ in range(2)]
    per_epoch = len(epochs[0])
    stops = [0, 1, per_epoch - 1, per_epoch + 2] if num_workers else [s for s in range(2 * per_epoch) if s != per_epoch]
    for stop in stops:
        epoch, index = divmod(stop, per_epoch)
        original = _loader(num_workers=num_workers)
        for _ in range(epoch):
            list(original)
        iterator = iter(original)
        for _ in range(index):
            next(iterator)
        state = copy.deepcopy(original.state_dict())
        del iterator
        resumed = _loader(num_workers=num_workers)
        resumed.load_state_dict(state)
        assert [_rows(b) for b in resumed] == epochs[epoch][index:], f"stop {stop}"
        if epoch == 0:
            assert [_rows(b) for b in resumed] == epochs[1], f"epoch after stop {stop}"


@pytest.mark.parametrize("drop_last", [False, True], ids=["keep-last", "drop-last"])
@pytest.mark.parametrize("shuffle", [False, True], ids=["in-order", "shuffled"])
def test_batches_and_mid_epoch_state_are_torchdatas(shuffle: bool, drop_last: bool) -> None:
    """The loader draws each batch's indices in one step; the batches and the resumed rest are torchdata's."""

    def loaders() -> tuple[StatefulDataLoader, eb.MicrobatchingDataLoader]:
        kwargs: dict[str, Any] = {"batch_size": 3, "shuffle": shuffle, "drop_last": drop_last}
        torch.manual_seed(5)
        plain = StatefulDataLoader(_dataset(16), **kwargs)
        torch.manual_seed(5)
        return plain, eb.MicrobatchingDataLoader(_dataset(16), **kwargs)

    plain, elastic = loaders()
    expected = [b[1].tolist() for b in plain]
    assert [_rows(b) for b in elastic] == expected and len(expected) == (5 if drop_last else 6)
    plain, elastic = loaders()
    plain_iter, elastic_iter = iter(plain), iter(elastic)
    for _ in range(2):
        next(plain_iter), next(elastic_iter)
    plain_state, elastic_state = plain.state_dict(), elastic.state_dict()
    ours, theirs = elastic_state["loader"]["_sampler_iter_state"], plain_state["_sampler_iter_state"]
    assert ours.keys() == theirs.keys() and ours["samples_yielded"] == theirs["samples_yielded"] == 6
    if shuffle:  # the shuffled order's own state is torchdata's: same keys, same position, same generator
        ours, theirs = ours["sampler_iter_state"], theirs["sampler_iter_state"]
        assert ours["yielded"] == theirs["yielded"] == 6 and torch.equal(ours["generator"], theirs["generator"])
    resumed_plain, resumed = loaders()
    resumed_plain.load_state_dict(plain_state)
    resumed.load_state_dict(elastic_state)
    assert [_rows(b) for b in resumed] == [b[1].tolist() for b in resumed_plain] == expected[2:]
    _, from_torchdata = loaders()  # a state saved by torchdata's own loader resumes here too
    from_torchdata.load_state_dict({**elastic_state, "loader": plain_state})
    assert [_rows(b) for b in from_torchdata] == expected[2:]


def test_whole_batches_drawn_one_index_at_a_time_are_shuffled_and_resumed_as_torchdatas() -> None:
    """With ``batch_size=None`` the loader takes the shuffled order's indices one by one."""
    dataset = [(torch.full((2, 3), float(i)), torch.full((2,), i)) for i in range(9)]  # each item a batch of 2

    def loaders() -> tuple[StatefulDataLoader, eb.MicrobatchingDataLoader]:
        torch.manual_seed(11)
        plain = StatefulDataLoader(dataset, batch_size=None, shuffle=True)
        torch.manual_seed(11)
        return plain, eb.MicrobatchingDataLoader(dataset, batch_size=None, shuffle=True)

    plain, elastic = loaders()
    expected = [b[1][0].item() for b in plain]
    assert [b.unwrap()[1][0].item() for b in elastic] == expected and sorted(expected) == list(range(9))
    plain, elastic = loaders()
    iterator = iter(elastic)
    for _ in range(4):
        next(iterator)
    state = elastic.state_dict()
    _, resumed = loaders()
    resumed.load_state_dict(state)
    assert [b.unwrap()[1][0].item() for b in resumed] == expected[4:]


def test_workers_snapshot_their_state_every_32_batches_unless_told_otherwise() -> None:
    """Sent every batch, the workers' state costs ~5% of a cheap batch; a resume replays up to 31 instead."""
    assert eb.MicrobatchingDataLoader(_dataset(), batch_size=4).snapshot_every_n_steps == 32
    assert eb.MicrobatchingDataLoader(DataLoader(_dataset(), batch_size=4)).snapshot_every_n_steps == 32
    stateful = StatefulDataLoader(_dataset(), batch_size=4, snapshot_every_n_steps=1)
    assert eb.MicrobatchingDataLoader(stateful).snapshot_every_n_steps == 1
    told = eb.MicrobatchingDataLoader(_dataset(), batch_size=4, snapshot_every_n_steps=5)
    assert told.snapshot_every_n_steps == 5


def test_state_restores_the_learned_split_count() -> None:
    controller = eb.SplitController()
    loader = _loader(controller)
    iterator = iter(loader)
    next(iterator)
    controller.record_oom(3, 3)  # learned: 2 microbatches for 3 rows
    next(iterator)
    state = loader.state_dict()
    resumed = _loader()
    resumed.load_state_dict(state)
    assert resumed.controller.state_dict() == controller.state_dict()
    assert {b.split_count for b in resumed if len(b) == 3} == {2}
    assert json.loads(json.dumps(state["controller"])) == state["controller"]


def _bad(**changes: Any) -> dict[str, Any]:
    state = _loader().state_dict()
    for key, value in changes.items():
        if value is None:
            del state[key]
        else:
            state[key] = value
    return state


@pytest.mark.parametrize(
    ("state", "message"),
    [
        (_bad(controller=None), r"missing keys \['controller'\], unexpected keys \[\]"),
        (_bad(extra=1), r"missing keys \[\], unexpected keys \['extra'\]"),
        (_bad(loader=None, extra=1), r"missing keys \['loader'\], unexpected keys \['extra'\]"),
        (_bad(version=2), r"state version 2 is not supported"),
        (_bad(batch_size=4), r"the state was saved with batch_size=4, this loader has batch_size=3"),
    ],
    ids=["missing", "unexpected", "missing-and-unexpected", "version", "batch-size"],
)
def test_bad_state_dict_names_the_problem(state: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=rf"MicrobatchingDataLoader\.load_state_dict: {message}"):
        _loader().load_state_dict(state)


def test_bad_controller_state_inside_a_loader_state_is_named_and_changes_nothing() -> None:
    saved = _loader()
    iterator = iter(saved)
    next(iterator)
    state = saved.state_dict()
    del state["controller"]["fits"]
    loader = _loader()
    expected = [_rows(b) for b in _loader()]
    with pytest.raises(ValueError, match=r"SplitController\.load_state_dict: missing keys \['fits'\]"):
        loader.load_state_dict(state)
    assert [_rows(b) for b in loader] == expected  # the position was not loaded either


def _saved_mid_epoch(**kwargs: Any) -> dict[str, Any]:
    """The state of a loader two batches into its epoch (``kwargs`` go to ``_loader``)."""
    saved = _loader(**kwargs)
    iterator = iter(saved)
    next(iterator), next(iterator)
    state = copy.deepcopy(saved.state_dict())
    del iterator
    return state


def _garbled(state: dict[str, Any], *path: str, value: Any) -> dict[str, Any]:
    state = copy.deepcopy(state)
    inner = state["loader"]
    for key in path[:-1]:
        inner = inner[key]
    inner[path[-1]] = value
    return state


def _misspelt(state: dict[str, Any]) -> dict[str, Any]:
    state["loader"]["fetcher_state_"] = state["loader"].pop("fetcher_state")
    return state


@pytest.mark.parametrize(
    ("garble", "message"),
    [
        (
            lambda state: _garbled(state, "_num_yielded", value="two"),
            r"state\['loader'\]\['_num_yielded'\] must be an int >= 0, got 'two'",
        ),
        (
            lambda state: _garbled(state, "_iterator_finished", value=0),
            r"state\['loader'\]\['_iterator_finished'\] must be a bool, got 0",
        ),
        (
            _misspelt,
            r"state\['loader'\] has missing keys \['fetcher_state'\] and unexpected keys \['fetcher_state_'\]",
        ),
        (
            lambda state: _garbled(state, "_sampler_iter_state", value={"yielded": 6}),
            r"state\['loader'\]\['_sampler_iter_state'\] must be a dict with an int 'samples_yielded'",
        ),
    ],
    ids=["count-a-string", "finished-an-int", "misspelt-key", "sampler-state"],
)
def test_a_garbled_position_is_refused_at_load_time_and_changes_nothing(
    garble: Callable[[dict[str, Any]], dict[str, Any]], message: str
) -> None:
    state = garble(_saved_mid_epoch())
    loader = _loader()
    learned = eb.SplitController()
    learned.record_oom(48, 48)
    loader.controller.load_state_dict(learned.state_dict())
    before = loader.controller.state_dict()
    expected = [_rows(b) for b in _loader()]
    with pytest.raises(ValueError, match=rf"MicrobatchingDataLoader\.load_state_dict: {message}"):
        loader.load_state_dict(state)
    assert loader.controller.state_dict() == before
    assert [_rows(b) for b in loader] == expected


def test_a_shuffled_position_out_of_the_epoch_is_refused() -> None:
    state = _saved_mid_epoch()  # _loader shuffles
    order = state["loader"]["_sampler_iter_state"]["sampler_iter_state"]
    order["yielded"] = 10**6
    with pytest.raises(ValueError, match=r"must hold the shuffled epoch's position \('yielded', 0 to \d+\)"):
        _loader().load_state_dict(state)


@pytest.mark.parametrize(("saved", "loaded"), [(0, 2), (2, 0), (2, 1)], ids=["0-to-2", "2-to-0", "2-to-1"])
def test_a_position_saved_with_other_workers_says_so(saved: int, loaded: int) -> None:
    state = _saved_mid_epoch(num_workers=saved)
    loader = _loader(num_workers=loaded)
    with pytest.raises(
        ValueError,
        match=rf"saved by a loader with num_workers={saved}, this loader has num_workers={loaded}.*"
        r"loader\.controller\.load_state_dict\(state\['controller'\]\)",
    ):
        loader.load_state_dict(state)
    loader.controller.load_state_dict(state["controller"])  # the documented way to keep what was learned


# ---------------------------------------------------------------------------------------------
# Arguments


class _ArgumentsLoader(DataLoader):
    """Like PyG's DataLoader: a subclass that only sets constructor arguments."""

    def __init__(self, dataset: Any, batch_size: int = 1, **kwargs: Any) -> None:
        super().__init__(dataset, batch_size=batch_size, collate_fn=_sum_collate, **kwargs)


def _sum_collate(samples: list[Any]) -> dict[str, torch.Tensor]:
    return {"x": torch.stack([x for x, _ in samples]), "y": torch.stack([y for _, y in samples])}


class _OwnIterLoader(DataLoader):
    def __iter__(self) -> Any:
        return super().__iter__()


class _OwnIteratorLoader(_ArgumentsLoader):
    def _get_iterator(self) -> Any:
        return super()._get_iterator()


class _OwnLengthLoader(StatefulDataLoader):
    def __len__(self) -> int:
        return 1


class _OwnStateLoader(StatefulDataLoader):
    def state_dict(self) -> dict[str, Any]:
        return {}


def test_wraps_a_dataloader_subclass_that_only_sets_arguments() -> None:
    plain = _ArgumentsLoader(_dataset(), batch_size=8)
    loader = eb.MicrobatchingDataLoader(plain, controller=eb.SplitController(split_count=2))
    batches = list(loader)
    assert [len(b) for b in batches] == [8, 8, 4]
    assert [len(mb) for mb in batches[0].microbatches()] == [4, 4]
    expected = [b["x"] for b in plain]
    assert all(torch.equal(b.unwrap()["x"], x) for b, x in zip(batches, expected, strict=True))


@pytest.mark.parametrize(
    ("cls", "method"),
    [
        (_OwnIterLoader, "_OwnIterLoader.__iter__"),
        (_OwnIteratorLoader, "_OwnIteratorLoader._get_iterator"),
        (_OwnLengthLoader, "_OwnLengthLoader.__len__"),
        (_OwnStateLoader, "_OwnStateLoader.state_dict"),
    ],
    ids=["__iter__", "_get_iterator", "__len__", "state_dict"],
)
def test_refuses_a_dataloader_subclass_with_its_own_iteration_naming_the_method(cls: type, method: str) -> None:
    with pytest.raises(TypeError, match=rf"cannot wrap a {cls.__name__}: it defines {method}, its own iteration"):
        eb.MicrobatchingDataLoader(cls(_dataset()))


def test_construction_prints_no_set_vital_deprecation() -> None:
    filters = list(warnings.filters)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eb.MicrobatchingDataLoader(_dataset(), batch_size=4)
        eb.MicrobatchingDataLoader(DataLoader(_dataset(), batch_size=4, shuffle=True))
    assert [str(w.message) for w in caught] == []
    assert warnings.filters == filters  # a filter around torchdata's call, not a global one


def test_other_warnings_of_the_construction_still_show(monkeypatch: pytest.MonkeyPatch) -> None:
    def set_vital(*args: Any) -> None:
        warnings.warn("'set_vital' is deprecated, please do not call", UserWarning, stacklevel=2)
        warnings.warn("another warning raised while the loader is built", UserWarning, stacklevel=2)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # reading the old torch.set_vital warns too
        monkeypatch.setattr(torch, "set_vital", set_vital)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        eb.MicrobatchingDataLoader(_dataset(), batch_size=4)
    assert [str(w.message) for w in caught] == ["another warning raised while the loader is built"]


def test_refuses_a_controller_that_is_not_a_split_controller() -> None:
    with pytest.raises(TypeError, match=r"controller must be an elastic_batches\.SplitController, got 2"):
        eb.MicrobatchingDataLoader(_dataset(), controller=2)


# ---------------------------------------------------------------------------------------------
# End to end: loader, step and optimizer give the plain loop's weights


def test_training_through_loader_and_step_matches_the_plain_loop() -> None:
    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))

    data = TensorDataset(torch.randn(40, 3, generator=torch.Generator().manual_seed(1)), torch.randn(40, 1))
    plain_model, elastic_model = model(), model()
    plain_opt = torch.optim.SGD(plain_model.parameters(), lr=0.1)
    elastic_opt = torch.optim.SGD(elastic_model.parameters(), lr=0.1)
    for x, y in DataLoader(data, batch_size=8):
        plain_opt.zero_grad()
        (plain_model(x) - y).pow(2).mean().backward()
        plain_opt.step()
    loader = eb.MicrobatchingDataLoader(data, batch_size=8)
    step = eb.ElasticStep(elastic_model, controller=loader.controller)
    with inject_oom(elastic_model[0], phase="backward", calls=[0, 3]):
        for batch in loader:
            elastic_opt.zero_grad()
            step.backward(batch, lambda mb: (elastic_model(mb[0]) - mb[1]).pow(2).mean())
            elastic_opt.step()
    assert loader.controller.oom_count == 2
    for a, b in zip(plain_model.parameters(), elastic_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_an_unknown_argument_names_the_loader_and_its_valid_arguments() -> None:
    with pytest.raises(
        TypeError, match=r"MicrobatchingDataLoader got unexpected keyword argument\(s\) \['bach_size'\]"
    ):
        eb.MicrobatchingDataLoader(TensorDataset(torch.zeros(4, 1)), bach_size=2)
    with pytest.raises(TypeError, match=r"'pad_values'.*'num_workers'"):
        eb.MicrobatchingDataLoader(TensorDataset(torch.zeros(4, 1)), bach_size=2)
