"""The model plug point and the native span model: the family a config names, shapes, which positions may
answer, gradient checkpointing that changes nothing, and outputs bitwise those of the model before the
plug point existed."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from elastic_qa.config import ConfigError, ModelConfig, config_from_dict, load_config, packaged_config
from elastic_qa.data.loader import collate
from elastic_qa.models import FAMILIES, family_for, model_inputs
from elastic_qa.models.loss import span_loss
from elastic_qa.models.native import _MASKED, SpanQA
from elastic_qa.prep.synthetic import generate
from elastic_qa.prep.tokenizer import PAD, SEP, WordTokenizer
from elastic_qa.prep.windows import build_features
from tests.conftest import FIXTURES

VOCAB = 512
CPU = torch.device("cpu")
# The last commit before the plug point: the span model was elastic_qa/model.py, called model(ids, segments).


@pytest.fixture(scope="module")
def batch():
    features = build_features(generate("train", 12, 7, 0.25), WordTokenizer(VOCAB), 64, 24, 32)
    return collate(features, torch.arange(len(features)).numpy())


def model_config(**changes):
    return dataclasses.replace(load_config(packaged_config("tiny")).model, **changes)


def make_model(seed: int = 0, **changes) -> SpanQA:
    cfg = dataclasses.replace(load_config(packaged_config("tiny")), model=model_config(**changes))
    torch.manual_seed(seed)
    return family_for(cfg.model).build_model(cfg, VOCAB)


def test_the_default_kind_is_the_native_span_model():
    assert ModelConfig().kind == "native"
    assert isinstance(make_model(), SpanQA)


def test_an_unknown_kind_is_a_config_error_naming_model_kind():
    with pytest.raises(ConfigError, match=r"^model\.kind='nope': must be one of native"):
        family_for(dataclasses.replace(ModelConfig(), kind="nope"))
    with pytest.raises(ConfigError, match=r"^model\.kind='nope'"):
        config_from_dict({"model": {"kind": "nope"}})
    assert set(FAMILIES) == {"native"}


def test_logits_are_float32_batch_by_length(batch):
    model = make_model()
    start, end = model(**model_inputs(batch, CPU))
    rows, length = batch["input_ids"].shape
    assert start.shape == end.shape == (rows, length)
    assert start.dtype == end.dtype == torch.float32
    assert torch.isfinite(start).all() and torch.isfinite(end).all()


def test_question_separator_and_padding_positions_get_the_masked_value(batch):
    model = make_model().eval()
    ids, segments = batch["input_ids"], batch["token_type_ids"]
    start, end = model(**model_inputs(batch, CPU))
    cannot_answer = (segments == 0) | (ids == SEP) | (ids == PAD)
    cannot_answer[:, 0] = False  # [CLS]: "no answer in this window"
    assert cannot_answer.any() and (ids == PAD).any()
    for logits in (start, end):
        assert (logits[cannot_answer] == _MASKED).all()
        assert (logits[~cannot_answer] != _MASKED).all()
        assert (logits[:, 0] != _MASKED).all()


def test_padding_does_not_change_the_logits_of_real_tokens(batch):
    model = make_model().eval()
    ids, segments = batch["input_ids"][:1], batch["token_type_ids"][:1]
    real = int((ids != PAD).sum())
    ones = torch.ones(1, real, dtype=torch.long)
    start, end = model(input_ids=ids[:, :real], attention_mask=ones, token_type_ids=segments[:, :real])
    padded = torch.cat([ids[:, :real], torch.full((1, 7), PAD)], dim=1)
    padded_segments = torch.cat([segments[:, :real], torch.zeros(1, 7, dtype=torch.long)], dim=1)
    mask = torch.cat([ones, torch.zeros(1, 7, dtype=torch.long)], dim=1)
    start_p, end_p = model(input_ids=padded, attention_mask=mask, token_type_ids=padded_segments)
    torch.testing.assert_close(start_p[:, :real], start, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(end_p[:, :real], end, rtol=1e-5, atol=1e-5)


def loss_and_grads(model: SpanQA, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.train()
    model.zero_grad()
    start, end = model(**model_inputs(batch, CPU))
    weights = torch.ones(len(batch["input_ids"]))
    loss = span_loss(start, end, batch["start_positions"], batch["end_positions"], weights)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_gradient_checkpointing_gives_the_same_loss_and_gradients(batch):
    plain = make_model(seed=3, n_layers=2)
    checkpointed = make_model(seed=3, n_layers=2, grad_checkpointing=True)
    checkpointed.load_state_dict(plain.state_dict())
    loss_a, grads_a = loss_and_grads(plain, batch)
    loss_b, grads_b = loss_and_grads(checkpointed, batch)
    torch.testing.assert_close(loss_b, loss_a)
    assert grads_a.keys() == grads_b.keys()
    assert any(name.startswith("layers.") for name in grads_a)
    for name, grad in grads_a.items():
        torch.testing.assert_close(grads_b[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_span_loss_is_a_weighted_sum_of_per_sample_losses(batch):
    model = make_model().eval()
    start, end = model(**model_inputs(batch, CPU))
    s, e = batch["start_positions"], batch["end_positions"]
    ones = torch.ones(len(s))
    total = span_loss(start, end, s, e, ones)
    singles = [
        span_loss(start[i : i + 1], end[i : i + 1], s[i : i + 1], e[i : i + 1], ones[:1]) for i in range(3)
    ]
    torch.testing.assert_close(span_loss(start[:3], end[:3], s[:3], e[:3], ones[:3]), sum(singles))
    weights = torch.zeros(len(s))
    weights[0] = 1.0
    torch.testing.assert_close(span_loss(start, end, s, e, weights), singles[0])
    assert total > 0


def test_a_zero_weight_sample_contributes_no_gradient(batch):
    model = make_model()
    start, end = model(**model_inputs(batch, CPU, slice(0, 1)))
    loss = span_loss(start, end, batch["start_positions"][:1], batch["end_positions"][:1], torch.zeros(1))
    loss.backward()
    assert loss.item() == 0.0
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())


def model_before_the_plug_point():
    """The span model module as it was before the plug point (commit 18003bc), stored with the tests."""
    path = FIXTURES / "model_before_plug_point.py"
    spec = importlib.util.spec_from_file_location("model_before_plug_point", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_the_native_family_is_bitwise_the_model_before_the_plug_point(batch, dropout):
    """Same seed -> same state_dict (keys and values: old checkpoints load), same logits, loss, gradients."""
    before = model_before_the_plug_point()
    torch.manual_seed(5)
    old = before.SpanQA(VOCAB, model_config(dropout=dropout))
    new = make_model(seed=5, dropout=dropout)
    old_state, new_state = old.state_dict(), new.state_dict()
    assert list(new_state) == list(old_state)
    assert all(torch.equal(new_state[k], old_state[k]) for k in old_state)
    new.load_state_dict(old_state)  # strict
    for model in (old, new):
        model.train()
        model.zero_grad()
    torch.manual_seed(9)
    old_start, old_end = old(batch["input_ids"], batch["token_type_ids"])
    torch.manual_seed(9)
    new_start, new_end = new(**model_inputs(batch, CPU))
    assert torch.equal(new_start, old_start) and torch.equal(new_end, old_end)
    targets = batch["start_positions"], batch["end_positions"], torch.ones(len(batch["input_ids"]))
    old_loss, new_loss = (
        before.span_loss(old_start, old_end, *targets),
        span_loss(new_start, new_end, *targets),
    )
    assert torch.equal(new_loss, old_loss)
    old_loss.backward()
    new_loss.backward()
    for (name, old_param), new_param in zip(old.named_parameters(), new.parameters(), strict=True):
        assert torch.equal(new_param.grad, old_param.grad), name
