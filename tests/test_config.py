"""The typed config tree: packaged files, dotted overrides, durations, errors naming key and value."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import yaml

from elastic_qa.cli import main as cli_main
from elastic_qa.config import (
    Config,
    ConfigError,
    config_from_dict,
    format_duration,
    load_config,
    packaged_config,
    packaged_config_names,
    parse_duration,
    resolve_config,
)
from elastic_qa.launcher.local import main as launcher_main

REPO = Path(__file__).resolve().parents[1]


def tiny(*overrides: str) -> Config:
    return load_config(packaged_config("tiny"), overrides)


def config_error(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        tiny(*overrides)
    return str(info.value)


PACKAGED = sorted(path.stem for path in (REPO / "elastic_qa" / "configs").glob("*.yaml"))


@pytest.mark.parametrize("name", PACKAGED)
def test_every_packaged_config_loads(name):
    cfg = load_config(packaged_config(name), complete=False)
    assert isinstance(cfg, Config)


def test_the_packaged_config_names_are_the_files_of_the_configs_directory():
    assert packaged_config_names() == PACKAGED and {"tiny", "hf-tiny", "hf-base"} <= set(PACKAGED)


def test_a_config_name_that_is_no_file_and_not_packaged_fails_listing_the_packaged_names(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)  # no file named tinyy here
    with pytest.raises(ConfigError) as info:
        resolve_config("tinyy")
    assert (
        str(info.value)
        == f"--config tinyy: no such file or packaged config (packaged: {', '.join(PACKAGED)})"
    )


@pytest.mark.parametrize(
    "command",
    [
        (cli_main, ["train", "--help"]),  # python -m elastic_qa.train's own
        (cli_main, ["prepare", "--help"]),
        (cli_main, ["config", "show", "--help"]),
        (launcher_main, ["start", "--help"]),  # launch/local.sh start
    ],
    ids=["train", "prepare", "config show", "launcher start"],
)
def test_every_config_option_names_every_packaged_config_in_its_help(command, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "400")  # one line per option: no name broken at its hyphen
    main, argv = command
    with pytest.raises(SystemExit):
        main(argv)
    [line] = [line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("--config")]
    assert line.endswith(f"packaged config: {', '.join(PACKAGED)}"), line


def test_packaged_configs_hold_the_values_their_files_set():
    assert tiny().train.max_steps == 40
    assert tiny().model.d_model == 32
    squad = load_config(packaged_config("squad"))
    assert squad.data.source == "train-v2.0.json"
    assert squad.checkpoint.keep_every_steps == 5000
    assert load_config(packaged_config("default")).checkpoint.interval == timedelta(minutes=30)


def test_no_path_loads_the_default_config():
    assert load_config().to_dict() == load_config(packaged_config("default")).to_dict()


def test_dotted_overrides_replace_values_of_their_type():
    cfg = tiny("train.max_steps=200", "checkpoint.interval=10s", "checkpoint.async=false", "run.dir=/x/y")
    assert cfg.train.max_steps == 200
    assert cfg.checkpoint.interval == timedelta(seconds=10)
    assert cfg.checkpoint.async_ is False
    assert cfg.run.dir == "/x/y"


def test_a_nested_dotted_override_reaches_the_synthetic_section():
    cfg = tiny("data.synthetic.seed=3")
    assert cfg.data.synthetic.seed == 3
    assert cfg.data.synthetic.train_examples == 2000  # the rest of the section is kept


def test_a_later_override_of_the_same_key_wins():
    assert tiny("train.max_steps=5", "train.max_steps=7").train.max_steps == 7


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("10s", 10), ("5m", 300), ("1h", 3600), ("250ms", 0.25), ("2d", 172800), ("90", 90), ("1.5s", 1.5)],
)
def test_durations_accept_units_and_bare_seconds(text, seconds):
    assert parse_duration(text) == timedelta(seconds=seconds)
    assert tiny(f"checkpoint.interval={text}").checkpoint.interval == timedelta(seconds=seconds)


def test_a_bare_number_duration_from_yaml_is_seconds():
    assert parse_duration(45) == timedelta(seconds=45)
    assert parse_duration(0.5) == timedelta(milliseconds=500)


@pytest.mark.parametrize("text", ["10 minutes", "-5s", "abc", "", "1e3s"])
def test_malformed_durations_are_rejected(text):
    with pytest.raises(ValueError):
        parse_duration(text)


@pytest.mark.parametrize(
    "value", [timedelta(0), timedelta(milliseconds=250), timedelta(seconds=1.5), timedelta(minutes=90)]
)
def test_format_duration_reads_back_as_the_same_duration(value):
    assert parse_duration(format_duration(value)) == value


def test_an_exponent_without_a_dot_is_accepted_for_float_fields(tmp_path):
    # PyYAML reads `1e-3` as the string "1e-3" (YAML 1.1 needs a dot); float fields must accept it.
    assert yaml.safe_load("lr: 1e-3")["lr"] == "1e-3"
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  lr: 1e-3\n")
    assert load_config(path).train.lr == pytest.approx(1e-3)
    assert tiny("train.lr=5e-4").train.lr == pytest.approx(5e-4)


def test_an_integer_is_accepted_for_a_float_field():
    cfg = tiny("train.grad_clip=2")
    assert cfg.train.grad_clip == 2.0
    assert isinstance(cfg.train.grad_clip, float)


def test_unknown_key_fails_naming_the_key():
    message = config_error("train.max_stepz=5")
    assert "train.max_stepz" in message
    assert "max_steps" in message  # the known keys are listed


def test_unknown_nested_key_fails_naming_the_dotted_key():
    assert "data.synthetic.colour" in config_error("data.synthetic.colour=red")


def test_unknown_key_in_a_yaml_file_fails_naming_the_dotted_key(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  d_model: 32\n  n_head: 2\n")
    with pytest.raises(ConfigError, match=r"model\.n_head"):
        load_config(path)


@pytest.mark.parametrize(
    ("override", "key", "value"),
    [
        ("train.max_steps=abc", "train.max_steps", "abc"),
        ("train.max_steps=2.5", "train.max_steps", "2.5"),
        ("train.max_steps=true", "train.max_steps", "True"),
        ("checkpoint.async=maybe", "checkpoint.async", "maybe"),
        ("checkpoint.async=1", "checkpoint.async", "1"),
        ("train.lr=fast", "train.lr", "fast"),
        ("train.precision=fp8", "train.precision", "fp8"),
        ("data.tokenizer=bpe", "data.tokenizer", "bpe"),
        ("run.dir=null", "run.dir", "None"),
        ("checkpoint.interval=soon", "checkpoint.interval", "soon"),
        ("train=5", "train", "5"),
    ],
)
def test_a_value_of_the_wrong_type_fails_naming_key_and_value(override, key, value):
    message = config_error(override)
    assert f"{key}=" in message
    assert value in message


@pytest.mark.parametrize(
    ("override", "key", "value"),
    [
        ("train.global_batch_size=-4", "train.global_batch_size", "-4"),
        ("train.micro_batch_size=0", "train.micro_batch_size", "0"),
        ("checkpoint.keep_last=0", "checkpoint.keep_last", "0"),
        ("checkpoint.interval=0s", "checkpoint.interval", "0s"),
        ("model.n_heads=3", "model.n_heads", "3"),
        ("data.doc_stride=37", "data.doc_stride", "37"),  # tiny: 64 - 24 - 3 = 37 context tokens
        ("data.max_query_len=61", "data.max_query_len", "61"),
        ("data.synthetic.unanswerable_fraction=1.0", "data.synthetic.unanswerable_fraction", "1.0"),
        ("train.lr=0", "train.lr", "0"),
        ("train.lr=nan", "train.lr", "nan"),
        ("model.dropout=1", "model.dropout", "1"),
        ("run.dir=", "run.dir", "''"),
        ("replica.max_group_restarts=-1", "replica.max_group_restarts", "-1"),
    ],
)
def test_an_impossible_value_fails_naming_key_and_value(override, key, value):
    message = config_error(override)
    assert f"{key}=" in message
    assert value in message.split(":")[0]  # the value sits with the key, before the reason


def test_n_heads_error_says_what_it_must_divide():
    assert "d_model=32" in config_error("model.n_heads=3")


def test_the_largest_doc_stride_that_leaves_room_is_accepted():
    assert tiny("data.doc_stride=36").data.doc_stride == 36


def test_an_override_without_equals_sign_is_rejected():
    with pytest.raises(ConfigError, match=r"train\.max_steps"):
        tiny("train.max_steps")


def test_an_override_below_a_plain_value_is_rejected():
    with pytest.raises(ConfigError, match=r"train\.max_steps"):
        tiny("train.max_steps.x=1")


def test_a_missing_config_file_fails_naming_the_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=r"nope\.yaml"):
        load_config(missing)


def test_invalid_yaml_fails_naming_the_file_and_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("train:\n  max_steps: 3\n  lr: [1, 2\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "broken.yaml" in str(info.value)
    assert "line" in str(info.value)


def test_a_yaml_file_that_is_not_a_mapping_is_rejected(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match=r"list\.yaml"):
        load_config(path)


@pytest.mark.parametrize("name", ["default", "tiny", "squad"])
def test_config_from_dict_round_trips_to_dict(name):
    cfg = load_config(packaged_config(name), ["checkpoint.interval=250ms", "dist.timeout=90s"])
    again = config_from_dict(cfg.to_dict())
    assert again == cfg
    assert again.to_dict() == cfg.to_dict()
    assert again.digest() == cfg.digest()


def test_config_from_dict_applies_overrides_without_touching_the_input():
    tree = tiny().to_dict()
    cfg = config_from_dict(tree, ["train.max_steps=9"])
    assert cfg.train.max_steps == 9
    assert tree["train"]["max_steps"] == 40


def test_config_from_dict_validates():
    tree = tiny().to_dict()
    tree["checkpoint"]["keep_last"] = 0
    with pytest.raises(ConfigError, match=r"checkpoint\.keep_last=0"):
        config_from_dict(tree)


def test_to_yaml_spells_async_without_underscore_and_reloads(tmp_path):
    cfg = tiny("checkpoint.async=false", "train.lr=1e-3")
    text = cfg.to_yaml()
    section = yaml.safe_load(text)["checkpoint"]
    assert section["async"] is False
    assert "async_" not in text
    path = tmp_path / "resolved.yaml"
    path.write_text(text)
    assert load_config(path) == cfg


def test_checkpoint_dir_defaults_to_the_run_directory():
    assert tiny("run.dir=/r").checkpoint_dir == str(Path("/r") / "checkpoints")
    allowed = tiny("run.dir=/r", "checkpoint.dir=memory://ck", "checkpoint.allow_non_persistent=true")
    assert allowed.checkpoint_dir == "memory://ck"


def test_a_checkpoint_dir_that_vanishes_with_the_process_is_refused_unless_allowed():
    with pytest.raises(ConfigError, match=r"checkpoint\.dir='memory://ck'.*allow_non_persistent"):
        tiny("run.dir=/r", "checkpoint.dir=memory://ck")


def test_train_on_a_memory_checkpoint_dir_exits_2_and_writes_nothing(tmp_path):
    """It used to train, rotate and exit 0, and every checkpoint vanished with the process."""
    run_dir = tmp_path / "run"
    result = run_train(tmp_path, "--config", "tiny", f"run.dir={run_dir}", "checkpoint.dir=memory://ck")
    assert_bad_config_exit(result, run_dir, "checkpoint.dir", "memory://")


# --- the worker entry point: a bad config exits 2 with one line, before anything is written ---


def run_train(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "elastic_qa.train", *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def assert_bad_config_exit(result: subprocess.CompletedProcess, run_dir: Path, *named: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert len(lines) == 1, lines
    for fact in named:
        assert fact in lines[0]
    assert not run_dir.exists()


def test_train_with_an_impossible_value_exits_2_naming_the_key_and_writes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    result = run_train(tmp_path, "--config", "tiny", f"run.dir={run_dir}", "checkpoint.keep_last=0")
    assert_bad_config_exit(result, run_dir, "checkpoint.keep_last", "0")


def test_train_with_a_missing_config_file_exits_2_naming_the_file(tmp_path):
    run_dir = tmp_path / "run"
    result = run_train(tmp_path, "--config", str(tmp_path / "absent.yaml"), f"run.dir={run_dir}")
    assert_bad_config_exit(result, run_dir, "absent.yaml")


def test_train_with_an_invalid_yaml_file_exits_2_naming_the_file(tmp_path):
    run_dir = tmp_path / "run"
    path = tmp_path / "broken.yaml"
    path.write_text("train: {max_steps: 3\n")
    result = run_train(tmp_path, "--config", str(path), f"run.dir={run_dir}")
    assert_bad_config_exit(result, run_dir, "broken.yaml")


def test_train_with_an_unknown_key_exits_2_naming_the_key(tmp_path):
    run_dir = tmp_path / "run"
    result = run_train(tmp_path, "--config", "tiny", f"run.dir={run_dir}", "train.max_stepz=3")
    assert_bad_config_exit(result, run_dir, "train.max_stepz")


def test_model_kind_hf_needs_a_name_or_path_and_native_refuses_one():
    assert "model.name_or_path='': needed by kind=hf" in config_error("model.kind=hf")
    assert "model.name_or_path='bert-base-uncased': only read by kind=hf" in config_error(
        "model.name_or_path=bert-base-uncased"
    )


def test_an_hf_config_without_a_model_loads_only_for_showing_and_names_what_is_unset():
    with pytest.raises(ConfigError, match=r"^model\.name_or_path='': needed by kind=hf$"):
        load_config(packaged_config("hf-tiny"))
    shown = load_config(packaged_config("hf-tiny"), complete=False)
    assert shown.unset() == "model.name_or_path='': needed by kind=hf"
    assert load_config(packaged_config("hf-tiny"), ["model.name_or_path=/m"]).unset() is None


def test_train_with_an_hf_config_without_a_model_exits_2_with_the_one_line(tmp_path):
    run_dir = tmp_path / "run"
    result = run_train(tmp_path, "--config", "hf-tiny", f"run.dir={run_dir}")
    assert_bad_config_exit(result, run_dir, "model.name_or_path='': needed by kind=hf")


def test_lr_schedule_is_cosine_unless_set_to_linear_or_constant():
    assert tiny().train.lr_schedule == "cosine"
    assert tiny("train.lr_schedule=linear").train.lr_schedule == "linear"
    assert "train.lr_schedule='step': must be one of cosine, linear, constant" in config_error(
        "train.lr_schedule=step"
    )


def test_dropout_null_is_the_pretrained_models_own_for_hf_and_zero_for_native():
    hf = ("model.kind=hf", "model.name_or_path=/m")
    assert tiny(*hf).model.dropout is None
    assert tiny(*hf, "model.dropout=0.2").model.dropout == 0.2
    assert yaml.safe_load(tiny(*hf).to_yaml())["model"]["dropout"] is None
    assert config_from_dict(tiny(*hf).to_dict()).model.dropout is None
    # native: null resolves to 0.0, so a native config reads (and digests) exactly as before null existed
    assert tiny("model.dropout=null").model.dropout == 0.0
    assert tiny("model.dropout=null").digest() == tiny("model.dropout=0.0").digest()
    assert "model.dropout='high': expected a number or null" in config_error("model.dropout=high")


def test_max_query_len_0_leaves_questions_uncut_while_a_one_token_question_fits():
    assert tiny("data.max_query_len=0").data.max_query_len == 0
    # tiny: 64 tokens; [CLS] + one question token + two [SEP] leave 60 context tokens, doc_stride < 60
    widest = tiny("data.max_query_len=0", "data.doc_stride=59").data
    assert widest.question_tokens(special_tokens=3) == 1
    assert tiny("data.max_query_len=0", "data.doc_stride=32").data.question_tokens(3) == 64 - 3 - 33
    assert tiny("data.max_query_len=24").data.question_tokens(3) == 24
    message = config_error("data.max_query_len=0", "data.doc_stride=60")
    assert message.startswith("data.doc_stride=60: must be in [0, 60)") and "one token" in message
    assert config_error("data.max_query_len=-1").startswith("data.max_query_len=-1: must be in [0, max_seq")


def test_the_packaged_hf_config_loads_with_a_model_path():
    cfg = load_config(packaged_config("hf-tiny"), ["model.name_or_path=/models/tiny-bert"])
    assert (cfg.model.kind, cfg.model.name_or_path, cfg.model.dropout) == ("hf", "/models/tiny-bert", 0.1)


def test_vocab_file_is_only_read_by_the_wordpiece_tokenizer():
    assert "data.vocab_file='tok.json': only read by tokenizer=wordpiece" in config_error(
        "data.vocab_file=tok.json"
    )
    pytest.importorskip("tokenizers")
    cfg = load_config(packaged_config("tiny"), ["data.tokenizer=wordpiece", "data.vocab_file=tok.json"])
    assert (cfg.data.tokenizer, cfg.data.vocab_file) == ("wordpiece", "tok.json")
