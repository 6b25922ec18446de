"""Windows as the model reads them: one row per window, in columns (the feature cache maps them)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Features:
    """Column arrays, one row per window (memory-mappable: plain numpy, no Python objects)."""

    input_ids: np.ndarray  # int32 [N, L], the tokenizer's padding id after the last token
    lengths: np.ndarray  # int32 [N]: real tokens in each window (padding follows them; no left padding)
    segment_ids: np.ndarray  # int8 [N, L]: 0 question, 1 context
    start_positions: np.ndarray  # int32 [N]: any max_seq_len DataConfig accepts (int16 stopped at 32767)
    end_positions: np.ndarray  # int32 [N]
    example_index: np.ndarray  # int32 [N]: which example a window came from
    offsets: np.ndarray | None  # int32 [N, L, 2]: character span of context tokens, -1 elsewhere
    # (the feature cache keeps offsets for the evaluation split only: training never reads them)

    COLUMNS = (
        "input_ids",
        "lengths",
        "segment_ids",
        "start_positions",
        "end_positions",
        "example_index",
        "offsets",
    )

    def __len__(self) -> int:
        return len(self.input_ids)
