"""The native family: a small transformer encoder with start/end span heads, on the built-in tokenizers."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from elastic_qa.config import Config, ModelConfig
from elastic_qa.data.cache import VOCAB_FILE
from elastic_qa.exits import UsageError
from elastic_qa.prep.tokenizer import PAD, SEP
from elastic_qa.prep.windows import BuiltinFeaturizer
from elastic_qa.prep.wordpiece import read_vocab_file

# Masked logits stay finite so that a window whose only valid position is [CLS] never produces NaN.
_MASKED = -1e4


def _rotary_tables(length: int, head_dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    angles = torch.outer(torch.arange(length, device=device).float(), inv_freq)
    return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


def _in_question(input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
    """1 where a context token also occurs in the question (DrQA's exact-match feature), else 0.

    It hands the model the lexical overlap that a small encoder otherwise needs many steps to discover.
    """
    question = (token_type_ids == 0) & (input_ids > SEP)  # question words, not [CLS]/[SEP]/padding
    same = input_ids[:, :, None] == input_ids[:, None, :]
    return ((same & question[:, None, :]).any(dim=2) & (token_type_ids == 1)).long()


class EncoderLayer(nn.Module):
    """Pre-norm self-attention with rotary positions, then a GELU feed-forward.

    Rotary positions make "the word right after the person's name" a relative pattern the attention can
    learn once, wherever the sentence sits in the context; learned absolute positions learn it per slot.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.dropout = cfg.dropout or 0.0  # a native config resolves null to 0.0 at load
        self.attn_norm = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.out = nn.Linear(cfg.d_model, cfg.d_model)
        self.ff_norm = nn.LayerNorm(cfg.d_model)
        self.ff = nn.Sequential(
            nn.Linear(cfg.d_model, cfg.d_ff),
            nn.GELU(),
            nn.Linear(cfg.d_ff, cfg.d_model),
            nn.Dropout(self.dropout),
        )
        self.attn_dropout = nn.Dropout(self.dropout)

    def forward(
        self, x: torch.Tensor, keep: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(batch, length, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        attended = F.scaled_dot_product_attention(
            q, k, v, attn_mask=keep, dropout_p=self.dropout if self.training else 0.0
        )
        x = x + self.attn_dropout(self.out(attended.transpose(1, 2).reshape(batch, length, width)))
        return x + self.ff(self.ff_norm(x))


class SpanQA(nn.Module):
    """Encodes `[CLS] question [SEP] context [SEP]` and scores every position as answer start and end.

    Position 0 ([CLS]) stands for "no answer in this window" (SQuAD v2 unanswerable questions).
    """

    def __init__(self, vocab_size: int, cfg: ModelConfig) -> None:
        super().__init__()
        self.grad_checkpointing = cfg.grad_checkpointing
        self.tokens = nn.Embedding(vocab_size, cfg.d_model, padding_idx=PAD)
        self.segments = nn.Embedding(2, cfg.d_model)  # token types; the name is a key checkpoints carry
        self.in_question = nn.Embedding(2, cfg.d_model)
        self.embed_norm = nn.LayerNorm(cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout or 0.0)
        self.head_dim = cfg.d_model // cfg.n_heads
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.n_layers))
        # No biases here: a shift common to every position cancels in the softmax over positions, so their
        # gradient is zero up to rounding, and Adam (g / sqrt(v)) would turn that rounding noise into
        # full-size steps that differ with the summation order, i.e. with the world size.
        self.final_norm = nn.LayerNorm(cfg.d_model, bias=False)
        self.span_head = nn.Linear(cfg.d_model, 2, bias=False)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Start and end logits, float32 [batch, length]; positions that cannot answer are masked.

        The transformers argument names: `attention_mask` is 1 for real tokens and 0 for padding,
        `token_type_ids` 0 for the question and 1 for the context.
        """
        length = input_ids.shape[1]
        positions = torch.arange(length, device=input_ids.device)
        keep = attention_mask.bool()[:, None, None, :]  # attend to real tokens only
        cos, sin = _rotary_tables(length, self.head_dim, input_ids.device)
        x = (
            self.tokens(input_ids)
            + self.segments(token_type_ids)
            + self.in_question(_in_question(input_ids, token_type_ids))
        )
        x = self.dropout(self.embed_norm(x))
        for layer in self.layers:
            if self.grad_checkpointing and self.training:
                x = checkpoint(layer, x, keep, cos, sin, use_reentrant=False)
            else:
                x = layer(x, keep, cos, sin)
        logits = self.span_head(self.final_norm(x)).float()
        answerable = ((token_type_ids == 1) & (input_ids != SEP)) | (positions == 0)
        logits = logits.masked_fill(~answerable.unsqueeze(-1), _MASKED)
        return logits[..., 0], logits[..., 1]


# The family's entries (models.FAMILIES): the model, and the tokenizer and windows of the data config.


def build_model(cfg: Config, vocab_size: int) -> SpanQA:
    return SpanQA(vocab_size, cfg.model)


WEIGHTS_FILE = "model.safetensors"


def _safetensors() -> Any:
    try:
        import safetensors.torch
    except ImportError:
        raise UsageError("exported weights need safetensors: pip install safetensors") from None
    return safetensors.torch


def export(model: nn.Module, cfg: Config, out: Path) -> None:
    """The weights as safetensors, and the wordpiece vocabulary as VOCAB_FILE; the resolved config beside
    them says how to build and tokenise."""
    weights = {name: t.detach().cpu().contiguous() for name, t in model.state_dict().items()}
    _safetensors().save_file(weights, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    if cfg.data.tokenizer == "wordpiece":
        (out / VOCAB_FILE).write_bytes(read_vocab_file(cfg.data.vocab_file))


def load_export(cfg: Config, directory: Path) -> tuple[nn.Module, Config]:
    if cfg.data.tokenizer == "wordpiece":  # the exported vocabulary, wherever the exporting machine had it
        cfg = dataclasses.replace(
            cfg, data=dataclasses.replace(cfg.data, vocab_file=str(directory / VOCAB_FILE))
        )
    model = build_model(cfg, tokenizer(cfg).vocab_size)
    model.load_state_dict(_safetensors().load_file(str(directory / WEIGHTS_FILE)))
    return model, cfg


# The built-in tokenizers' windows.
tokenizer = BuiltinFeaturizer.tokenizer
features = BuiltinFeaturizer.features
cache_identity = BuiltinFeaturizer.cache_identity
store_vocabulary = BuiltinFeaturizer.store_vocabulary
