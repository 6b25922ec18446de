"""train.epochs: one length setting, resolved to steps once, recorded, kept by a resume."""

from __future__ import annotations

import pytest

from elastic_qa.config import ConfigError, TrainConfig, load_config, packaged_config
from elastic_qa.run_length import end_step, length_record


def test_epochs_and_max_steps_together_are_one_config_error_naming_both() -> None:
    with pytest.raises(ConfigError) as refused:
        load_config(packaged_config("tiny"), ["train.epochs=2"])  # tiny sets max_steps: 40
    message = str(refused.value)
    assert message.startswith("train.epochs=2:") and "train.max_steps=40" in message
    assert "train.max_steps=0" in message  # and says how to train by epochs


def test_a_run_without_a_length_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"^train.max_steps=0: must be >= 1, unless train.epochs"):
        load_config(packaged_config("tiny"), ["train.max_steps=0"])
    with pytest.raises(ConfigError, match=r"^train.epochs=-1: must be >= 0"):
        load_config(packaged_config("tiny"), ["train.max_steps=0", "train.epochs=-1"])


def test_epochs_resolve_to_whole_steps_per_epoch_the_last_taking_what_is_left() -> None:
    by_epochs = TrainConfig(max_steps=0, epochs=3, global_batch_size=16)
    assert end_step(by_epochs, train_windows=100) == 3 * 7  # 6 batches of 16 and one of 4, per epoch
    assert end_step(by_epochs, train_windows=96) == 3 * 6
    assert end_step(TrainConfig(max_steps=50), train_windows=100) == 50


def test_a_recorded_resolution_is_kept_for_the_same_epochs_and_redone_for_others() -> None:
    first = TrainConfig(max_steps=0, epochs=3, global_batch_size=16)
    recorded = length_record(first, end_step(first, 100))
    assert recorded == {"epochs": 3, "end_step": 21}
    larger_batch = TrainConfig(max_steps=0, epochs=3, global_batch_size=50)
    assert end_step(larger_batch, 100, recorded) == 21  # the recorded end: the batch changed, not the length
    more_epochs = TrainConfig(max_steps=0, epochs=4, global_batch_size=50)
    assert end_step(more_epochs, 100, recorded) == 4 * 2  # another train.epochs: resolved anew
    assert end_step(TrainConfig(max_steps=30), 100, recorded) == 30  # max_steps: the recording is moot
