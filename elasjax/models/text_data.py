"""The GPT's data: token windows of a byte-level corpus (`stdlib`: the standard library's `.py`
files, real text that ships with every Python, split into train and validation by a hash of each
file's relative path, so the split is fixed for a given Python version; runs are comparable on
the same interpreter) or synthetic affine sequences (`synthetic`: `x[t+1] = (a*x[t] + c) mod V`,
learnable and cheap). Which windows a step uses is `elasjax.loop.data`'s.
"""

from __future__ import annotations

import functools
import os
import sysconfig
import zlib
from pathlib import Path

import numpy as np

from ..config import DataConfig, ModelConfig


@functools.lru_cache(maxsize=4)
def _stdlib_bytes(max_bytes: int, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
        files += [Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py")]
    files.sort(key=lambda p: str(p.relative_to(root)))
    cut = int(round(val_fraction * 1000))
    train, val, n_train, n_val = [], [], 0, 0
    max_val = max(int(max_bytes * val_fraction), 1)
    for p in files:
        is_val = zlib.crc32(str(p.relative_to(root)).encode()) % 1000 < cut
        if (is_val and n_val >= max_val) or (not is_val and n_train >= max_bytes):
            continue
        try:
            b = p.read_bytes() + b"\n"
        except OSError:
            continue
        if is_val:
            val.append(b)
            n_val += len(b)
        else:
            train.append(b)
            n_train += len(b)
        if n_train >= max_bytes and n_val >= max_val:
            break
    to_arr = lambda parts, cap: np.frombuffer(b"".join(parts)[:cap], dtype=np.uint8)
    return to_arr(train, max_bytes), to_arr(val, max_val)


class TokenSource:
    """Fixed-length windows of `seq_len + 1` tokens; index -> window, for both splits."""

    def __init__(self, train: np.ndarray, val: np.ndarray, seq_len: int):
        self.seq_len = seq_len
        self._train, self._val = train, val
        self.n_train = (len(train) - 1) // seq_len
        self.n_val = (len(val) - 1) // seq_len
        if self.n_train < 1 or self.n_val < 1:
            raise ValueError(
                f"the corpus is too small for seq_len={seq_len}: {self.n_train} train and "
                f"{self.n_val} validation windows; raise data.max_bytes"
            )

    def windows(self, idx: np.ndarray, split: str = "train") -> np.ndarray:
        arr = self._train if split == "train" else self._val
        T = self.seq_len
        offs = idx[:, None] * T + np.arange(T + 1)[None, :]
        return arr[offs].astype(np.int32)

    def examples(self, idx: np.ndarray, split: str = "train") -> dict[str, np.ndarray]:
        """The GPT's examples (`modelspec.DataSource`): inputs and next-token targets."""
        w = self.windows(idx, split)
        return {"inputs": w[..., :-1], "targets": w[..., 1:]}


class SyntheticSource(TokenSource):
    def __init__(self, n_samples: int, seq_len: int, vocab: int, seed: int):
        self.seq_len, self.vocab, self.seed = seq_len, vocab, seed
        self.n_train = n_samples
        self.n_val = max(n_samples // 8, 1)

    def windows(self, idx: np.ndarray, split: str = "train") -> np.ndarray:
        salt = 0 if split == "train" else 1 << 30
        out = np.empty((len(idx), self.seq_len + 1), np.int32)
        for r, i in enumerate(idx):
            g = np.random.default_rng([self.seed, int(i) + salt])
            a = int(g.integers(1, 8)) * 2 + 1
            c = int(g.integers(0, self.vocab))
            x = int(g.integers(0, self.vocab))
            for t in range(self.seq_len + 1):
                out[r, t] = x
                x = (a * x + c) % self.vocab
        return out


def make_source(cfg: DataConfig, model: ModelConfig) -> TokenSource:
    if cfg.source == "stdlib":
        if model.vocab_size < 256:
            raise ValueError(
                f"data.source = 'stdlib' needs model.vocab_size >= 256 (bytes), got {model.vocab_size}"
            )
        train, val = _stdlib_bytes(cfg.max_bytes, cfg.val_fraction)
        return TokenSource(train, val, model.seq_len)
    return SyntheticSource(cfg.synthetic_samples, model.seq_len, model.vocab_size, cfg.seed)
