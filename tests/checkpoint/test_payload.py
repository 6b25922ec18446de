"""The state that goes into a checkpoint: RNG states, the weights_only safety check, CPU snapshots."""

from __future__ import annotations

import collections
import enum
import io
import random
from typing import Any

import numpy as np
import pytest
import torch

from elastic_qa.checkpoint.payload import check_safe, cpu_copy, rng_state, set_rng_state, versions
from elastic_qa.config import load_config, packaged_config
from tests.checkpoint.helpers import Trainee, trainer_state


def weights_only_roundtrip(obj: Any) -> Any:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def draws() -> tuple[list[float], list[float], list[float], torch.Tensor]:
    return (
        [random.random() for _ in range(5)] + [random.gauss(0, 1) for _ in range(3)],
        np.random.rand(5).tolist() + [float(np.random.standard_normal()) for _ in range(3)],
        [float(np.random.randint(0, 2**31)) for _ in range(3)],
        torch.randn(5),
    )


def test_rng_states_survive_a_weights_only_roundtrip_and_repeat_the_same_draws() -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    # Leave a cached Gaussian in python's and numpy's generators: part of the state too.
    random.gauss(0, 1)
    np.random.standard_normal()
    saved = weights_only_roundtrip(rng_state())
    expected = draws()

    draws()  # move every generator on
    set_rng_state(saved)

    again = draws()
    assert again[:3] == expected[:3]
    assert torch.equal(again[3], expected[3])


def test_on_cuda_only_the_current_device_generator_is_saved_and_restored(monkeypatch) -> None:
    """A regrouped rank may sit on another local GPU: its own generator state must follow it, and no
    other device is touched (a fake torch.cuda: no GPU here)."""
    touched: list[tuple[str, Any]] = []
    state_of_current = torch.arange(16, dtype=torch.uint8)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(
        torch.cuda, "get_rng_state", lambda device="cuda": touched.append(("get", device)) or state_of_current
    )
    monkeypatch.setattr(
        torch.cuda, "set_rng_state", lambda state, device="cuda": touched.append(("set", device, state))
    )
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: pytest.fail("read every device's generator"))
    monkeypatch.setattr(
        torch.cuda, "set_rng_state_all", lambda states: pytest.fail("set every device's generator")
    )

    saved = weights_only_roundtrip(rng_state())
    set_rng_state(saved)

    assert torch.equal(saved["cuda"], state_of_current)
    assert touched[0] == ("get", "cuda") and touched[1][:2] == ("set", "cuda")
    assert torch.equal(touched[1][2], state_of_current)


def test_restoring_one_rng_state_twice_gives_the_same_draws_twice() -> None:
    state = weights_only_roundtrip(rng_state())
    set_rng_state(state)
    first = draws()
    set_rng_state(state)
    second = draws()
    assert first[:3] == second[:3] and torch.equal(first[3], second[3])


class Custom:
    pass


class DictSubclass(dict):
    pass


class ListSubclass(list):
    pass


class Colour(enum.IntEnum):
    RED = 1


Pair = collections.namedtuple("Pair", "a b")

UNSAFE = {
    "torch-version-str-subclass": torch.__version__,
    "numpy-array": np.zeros(3),
    "numpy-scalar": np.float64(1.0),
    "custom-class": Custom(),
    "nested-custom-class": {"a": [1, {"b": Custom()}]},
    "parameter": torch.nn.Parameter(torch.ones(2)),
    "namedtuple": Pair(1, 2),
    "dict-subclass": DictSubclass(a=1),
    "defaultdict": collections.defaultdict(int, a=1),
    "list-subclass": ListSubclass([1, 2]),
    "str-subclass-key": {torch.__version__: 1},
    "int-enum-key": {Colour.RED: 1},
    "int-enum-value": Colour.RED,
    "set": {1, 2},
    "object-key": {(1, 2): 3},
}


@pytest.mark.parametrize("obj", list(UNSAFE.values()), ids=list(UNSAFE))
def test_check_safe_refuses_what_is_not_plain_data(obj: Any) -> None:
    with pytest.raises(TypeError):
        check_safe({"trainer": {"x": obj}}, "trainer.pt")


def test_check_safe_names_where_the_offending_object_is() -> None:
    with pytest.raises(TypeError, match=r"trainer\.pt\.versions\.torch"):
        check_safe({"versions": {"torch": torch.__version__}}, "trainer.pt")


def test_check_safe_accepts_the_trainer_state_shapes() -> None:
    trainee = Trainee()
    trainee.train(2)
    for name, state in trainee.state().items():
        check_safe(state, name)
    check_safe(load_config(packaged_config("tiny")).to_dict(), "config")
    check_safe(rng_state(), "rng")
    check_safe(versions(), "versions")
    check_safe({"dtype": torch.float16, "size": [2, 3], "none": None, "flag": True, "x": 1.5}, "misc")


CANDIDATES = {
    **UNSAFE,
    "trainer-state": trainer_state(3),
    "ordered-dict": collections.OrderedDict(a=torch.ones(1)),
    "tuple": (1, 2.0, "x", None),
    "torch-size": torch.Size([2, 3]),
    "bool-key": {True: 1},
    "int-key": {0: {"step": torch.tensor(1.0)}},
    "dtype": torch.bfloat16,
}


@pytest.mark.parametrize("obj", list(CANDIDATES.values()), ids=list(CANDIDATES))
def test_whatever_check_safe_accepts_loads_with_weights_only(obj: Any) -> None:
    """The check exists to catch at save time what weights_only loading would refuse at resume time."""
    try:
        check_safe(obj)
    except TypeError:
        return
    weights_only_roundtrip(obj)


def test_cpu_copy_is_a_deep_copy_that_training_cannot_change() -> None:
    weight = torch.ones(3)
    state = {"model": {"w": weight}, "list": [torch.zeros(2), 5], "tuple": (torch.ones(1), "s"), "n": None}

    copy = cpu_copy(state)
    weight.add_(1)
    state["list"][0].fill_(7)
    state["tuple"][0].mul_(3)
    state["model"]["extra"] = 1

    assert torch.equal(copy["model"]["w"], torch.ones(3))
    assert torch.equal(copy["list"][0], torch.zeros(2)) and copy["list"][1] == 5
    assert torch.equal(copy["tuple"][0], torch.ones(1)) and copy["tuple"][1] == "s"
    assert isinstance(copy["tuple"], tuple) and copy["n"] is None
    assert "extra" not in copy["model"]
    assert copy["model"]["w"].data_ptr() != weight.data_ptr()


def test_cpu_copy_of_a_live_optimizer_state_does_not_follow_later_steps() -> None:
    trainee = Trainee()
    trainee.train(1)
    snapshot = cpu_copy(trainee.state())
    frozen = {k: v.clone() for k, v in trainee.model.state_dict().items()}

    trainee.train(3)

    for key, value in frozen.items():
        assert torch.equal(snapshot["model.pt"][key], value)
        assert not snapshot["model.pt"][key].requires_grad


def test_versions_are_plain_strings_that_load_with_weights_only() -> None:
    info = versions()
    assert set(info) == {"elastic_qa", "torch", "python"}
    assert all(type(value) is str for value in info.values())
    assert weights_only_roundtrip(info) == info
