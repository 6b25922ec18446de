"""The start-up probe for parameters the span loss cannot see, and the weight-decay groups."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from elastic_qa.config import load_config, packaged_config
from elastic_qa.data.loader import collate
from elastic_qa.models import family_for
from elastic_qa.models.invariance import PROBE_TOKENS, _first_tokens, freeze, loss_invariant_parameters
from elastic_qa.optim import build_optimizer, decay_groups
from elastic_qa.prep import synthetic

INPUTS = ("input_ids", "attention_mask", "token_type_ids")


def model_and_batch(*overrides: str):
    cfg = load_config(packaged_config("hf-tiny" if overrides else "tiny"), list(overrides))
    family = family_for(cfg.model)
    features = family.features(synthetic.generate("train", 12, seed=1, unanswerable_fraction=0.2), cfg)
    torch.manual_seed(0)
    model = family.build_model(cfg, family.tokenizer(cfg).vocab_size)
    return model, collate(features, np.arange(4)), family.span_loss_per_window


def loss64(model, batch, loss) -> float:
    with torch.no_grad():
        start, end = model(**{k: batch[k] for k in INPUTS})
        return float(loss(start, end, batch["start_positions"], batch["end_positions"]).sum())


@pytest.mark.parametrize(("style", "encoder"), [("bert", "bert"), ("roberta", "roberta")])
def test_probe_finds_the_key_biases_the_qa_bias_and_the_last_layernorm_bias(hf_models, style, encoder):
    model, batch, loss = model_and_batch(f"model.name_or_path={hf_models[style]}")
    found = loss_invariant_parameters(model, batch, loss)
    assert set(found) == {
        f"model.{encoder}.encoder.layer.0.attention.self.key.bias",
        f"model.{encoder}.encoder.layer.1.attention.self.key.bias",
        f"model.{encoder}.encoder.layer.1.output.LayerNorm.bias",
        "model.qa_outputs.bias",
    }


def test_the_loss_ignores_exactly_the_parameters_the_probe_finds(hf_models):
    model, batch, loss = model_and_batch(f"model.name_or_path={hf_models['bert']}")
    found = set(loss_invariant_parameters(model, batch, loss))
    model = model.double().eval()
    before = loss64(model, batch, loss)
    generator = torch.Generator().manual_seed(1)
    for name, param in model.named_parameters():
        saved = param.detach().clone()
        with torch.no_grad():
            param.add_(torch.randn(param.shape, generator=generator, dtype=param.dtype))
        moved = abs(loss64(model, batch, loss) - before)
        with torch.no_grad():
            param.copy_(saved)
        # float64 rounding is ~1e-16: far below one bound, far above the other
        if name in found:
            assert moved < 1e-11 * abs(before), name
        else:
            assert moved > 1e-8 * abs(before), name


def test_the_native_model_has_no_loss_invariant_parameter_and_the_probe_leaves_it_untouched():
    model, batch, loss = model_and_batch()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    assert loss_invariant_parameters(model, batch, loss) == []
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


def test_frozen_parameters_are_left_out_of_the_optimizer(hf_models):
    model, batch, loss = model_and_batch(f"model.name_or_path={hf_models['roberta']}")
    names = loss_invariant_parameters(model, batch, loss)
    freeze(model, names)
    cfg = load_config(packaged_config("hf-tiny"), [f"model.name_or_path={hf_models['roberta']}"])
    optimized = {id(p) for group in build_optimizer(model, cfg).param_groups for p in group["params"]}
    params = dict(model.named_parameters())
    assert {n for n, p in params.items() if id(p) not in optimized} == set(names)


def test_weight_decay_skips_biases_norms_and_embeddings_by_module_type(hf_models):
    model, _, _ = model_and_batch(f"model.name_or_path={hf_models['bert']}")
    decay, no_decay = decay_groups(model)
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay}
    assert decayed == {
        n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) for n in [f"{n}.weight"]
    }
    assert len(decay) + len(no_decay) == len(names)


def test_native_weight_decay_groups_are_the_ones_its_parameter_names_gave():
    model, _, _ = model_and_batch()
    decay, _ = decay_groups(model)
    by_name = [
        p
        for n, p in model.named_parameters()
        if p.ndim >= 2 and not any(k in n for k in ("tokens", "segments", "in_question"))
    ]
    assert [id(p) for p in decay] == [id(p) for p in by_name]


def test_the_probe_reads_only_the_first_tokens_and_finds_the_same_set_on_long_windows(hf_models):
    # 128-token windows: the probe cuts them to PROBE_TOKENS; an answer beyond the cut becomes "no answer"
    model, batch, loss = model_and_batch(
        f"model.name_or_path={hf_models['bert']}", "data.max_seq_len=128", "data.doc_stride=32"
    )
    assert batch["input_ids"].shape[1] > PROBE_TOKENS
    cut = _first_tokens(batch, PROBE_TOKENS)
    assert cut["input_ids"].shape[1] == PROBE_TOKENS and cut["attention_mask"].shape[1] == PROBE_TOKENS
    beyond = (batch["start_positions"] >= PROBE_TOKENS) | (batch["end_positions"] >= PROBE_TOKENS)
    assert torch.equal(cut["start_positions"][beyond], torch.zeros(int(beyond.sum()), dtype=torch.long))
    kept = ~beyond
    assert beyond.any() and kept.any()  # both cases occur in these windows
    assert torch.equal(cut["start_positions"][kept], batch["start_positions"][kept])
    found = set(loss_invariant_parameters(model, batch, loss))
    assert "model.qa_outputs.bias" in found and len(found) == 4
