"""A real-text corpus that needs no download: the installed Python standard library's source.

Bytes are tokens (vocabulary 256). The file list is sorted and the split is by position, so
the corpus, its train/validation split and every sampled batch are the same on every run
and every mesh shape (given the same Python version).
"""

from __future__ import annotations

import functools
import pathlib
import sysconfig

import numpy as np

VOCAB_SIZE = 256


@functools.lru_cache(maxsize=4)
def stdlib_corpus(max_bytes: int = 8_000_000) -> np.ndarray:
    """Concatenated ``.py`` sources of the standard library, ``uint8 [<= max_bytes]``.

    Skips ``site-packages`` and the stdlib's own test suites (highly repetitive data files).
    """
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        p
        for p in root.rglob("*.py")
        if "site-packages" not in p.parts and "test" not in p.parts and "tests" not in p.parts
    )
    if not files:
        raise RuntimeError(f"no .py files under {root}; cannot build the stdlib corpus")
    chunks, total = [], 0
    for p in files:
        try:
            b = p.read_bytes()
        except OSError:
            continue
        chunks.append(b)
        total += len(b)
        if total >= max_bytes:
            break
    data = np.frombuffer(b"\n".join(chunks), dtype=np.uint8)[:max_bytes]
    return data


def train_val_split(data: np.ndarray, val_fraction: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """The last ``val_fraction`` of the corpus is held out."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    cut = int(len(data) * (1.0 - val_fraction))
    return data[:cut], data[cut:]


def sample_batch(data: np.ndarray, batch: int, seq_len: int, *, seed: int, step: int) -> np.ndarray:
    """``int32 [batch, seq_len + 1]`` windows; inputs are ``[:, :-1]``, targets ``[:, 1:]``.

    Depends only on ``(seed, step)``, so a resumed run or another mesh sees the same data.
    """
    if len(data) <= seq_len + 1:
        raise ValueError(f"corpus of {len(data)} bytes is too short for seq_len={seq_len}")
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(data) - seq_len - 1, size=batch)
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    return data[idx].astype(np.int32)
