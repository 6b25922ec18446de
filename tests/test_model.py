"""The span model: shapes, which positions may answer, and gradient checkpointing that changes nothing."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from elastic_qa.config import load_config, packaged_config
from elastic_qa.data.features import build_features
from elastic_qa.data.loader import collate
from elastic_qa.data.synthetic import generate
from elastic_qa.data.tokenizer import PAD, SEP, WordTokenizer
from elastic_qa.model import _MASKED, SpanQA, span_loss

VOCAB = 512


@pytest.fixture(scope="module")
def batch():
    features = build_features(generate("train", 12, 7, 0.25), WordTokenizer(VOCAB), 64, 24, 32)
    return collate(features, torch.arange(len(features)).numpy())


def model_config(**changes):
    return dataclasses.replace(load_config(packaged_config("tiny")).model, **changes)


def make_model(seed: int = 0, **changes) -> SpanQA:
    torch.manual_seed(seed)
    return SpanQA(VOCAB, model_config(**changes))


def test_logits_are_float32_batch_by_length(batch):
    model = make_model()
    start, end = model(batch["input_ids"], batch["segment_ids"])
    rows, length = batch["input_ids"].shape
    assert start.shape == end.shape == (rows, length)
    assert start.dtype == end.dtype == torch.float32
    assert torch.isfinite(start).all() and torch.isfinite(end).all()


def test_question_separator_and_padding_positions_get_the_masked_value(batch):
    model = make_model().eval()
    ids, segments = batch["input_ids"], batch["segment_ids"]
    start, end = model(ids, segments)
    cannot_answer = (segments == 0) | (ids == SEP) | (ids == PAD)
    cannot_answer[:, 0] = False  # [CLS]: "no answer in this window"
    assert cannot_answer.any() and (ids == PAD).any()
    for logits in (start, end):
        assert (logits[cannot_answer] == _MASKED).all()
        assert (logits[~cannot_answer] != _MASKED).all()
        assert (logits[:, 0] != _MASKED).all()


def test_padding_does_not_change_the_logits_of_real_tokens(batch):
    model = make_model().eval()
    ids, segments = batch["input_ids"][:1], batch["segment_ids"][:1]
    real = int((ids != PAD).sum())
    start, end = model(ids[:, :real], segments[:, :real])
    padded = torch.cat([ids[:, :real], torch.full((1, 7), PAD)], dim=1)
    padded_segments = torch.cat([segments[:, :real], torch.zeros(1, 7, dtype=torch.long)], dim=1)
    start_p, end_p = model(padded, padded_segments)
    torch.testing.assert_close(start_p[:, :real], start, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(end_p[:, :real], end, rtol=1e-5, atol=1e-5)


def loss_and_grads(model: SpanQA, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.train()
    model.zero_grad()
    start, end = model(batch["input_ids"], batch["segment_ids"])
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
    start, end = model(batch["input_ids"], batch["segment_ids"])
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
    start, end = model(batch["input_ids"][:1], batch["segment_ids"][:1])
    loss = span_loss(start, end, batch["start_positions"][:1], batch["end_positions"][:1], torch.zeros(1))
    loss.backward()
    assert loss.item() == 0.0
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())
