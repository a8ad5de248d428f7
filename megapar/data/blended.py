"""Blended datasets: several datasets mixed by weight (``--data 0.7 PREFIX_A 0.3 PREFIX_B``).

Sample ``i`` of the blend is the ``k``-th draw from dataset ``dataset_index[i]``. The
interleaving is a pure function of the weights and the size: the ``k``-th draw of dataset ``d``
is due at time ``(k + 1/2) / w_d`` and the blend takes draws in order of due time (ties to the
lower dataset index), so every run of consecutive samples holds each dataset in proportion to
its weight, within about one sample. Draws walk through a seeded permutation of the dataset's
samples, a new one each time the dataset is exhausted (a dataset weighted above its share of
the data is repeated, as in Megatron-LM). So the blend is already shuffled: the global batch
sampler takes it in order (and splits it over data-parallel ranks as usual), which keeps the
proportions in every global batch. An epoch past the first (blend index ``e * len + j``)
repeats the interleaving with each dataset's draws continuing where the epoch before left off,
so a dataset's samples one epoch leaves undrawn are drawn by the next. Nothing depends on the
parallel layout, and since the blend is a fixed sequence, resuming from the sampler's saved
position is exact (at any global batch).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import numpy as np


def _names_data(path: str) -> bool:
    """Whether `path` names existing data: a file, a directory or a dataset prefix."""
    path = os.path.expanduser(path)
    return os.path.exists(path) or any(os.path.exists(path + ext) for ext in (".idx", ".bin"))


def _is_weight(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def parse_blend(spec) -> list[tuple[float, str]] | None:
    """[(weight, prefix)] from Megatron's "W1 P1 W2 P2 ..." (a string or a list), or None for a
    single path. Weights are normalised to sum to 1; a part weighted 0 is switched off, as in
    Megatron-LM: it is not among the pairs (`unweighted_parts` names it).

    Paths are paths: a string that names existing data, or does not start with a weight, is one
    path whatever spaces it holds (so is a list of one item); only what parses as WEIGHT PATH
    pairs is a blend (a list: `--data 0.7 A 0.3 B`, a `--config` list, or such a string)."""
    pairs = _weighted_pairs(spec)
    if pairs is None:
        return None
    total = sum(w for w, _ in pairs)
    return [(w / total, p) for w, p in pairs if w > 0]


def unweighted_parts(spec) -> list[str]:
    """The prefixes of a blend given weight 0 (not drawn); [] for a single path."""
    return [p for w, p in _weighted_pairs(spec) or [] if w == 0]


def _weighted_pairs(spec) -> list[tuple[float, str]] | None:
    """`parse_blend`'s pairs as given (weights not normalised, 0s kept); raises ValueError for
    a malformed blend, a negative or non-finite weight, or weights that are all 0."""
    if isinstance(spec, str):
        items = spec.split()
        if _names_data(spec) or len(items) < 2 or not _is_weight(items[0]):
            return None
    else:
        items = [str(x) for x in spec]
        if len(items) == 1:
            return None
    quote = (
        f" (a path with spaces is one argument: quote it, --data '{' '.join(items)}')"
        if not isinstance(spec, str) and _names_data(" ".join(items))
        else ""
    )
    if not quote and not _is_weight(items[0]) and all(_names_data(x) for x in items):
        raise ValueError(  # several paths (a shell glob, --data corpus/*.txt), no weights
            f"--data takes one path or a blend of WEIGHT PATH pairs, got {len(items)} paths "
            f"({' '.join(items[:3])}{' ...' if len(items) > 3 else ''}); pass the directory "
            f"that holds them (its .txt / .jsonl / .json / .parquet files are read), tokenize "
            f"them together (megapar-data --input A B --output-prefix P, then --data P), or "
            f"weight them: --data 0.5 A 0.5 B"
        )
    if len(items) % 2:
        raise ValueError(
            f"--data {' '.join(items)}: a blend is pairs of WEIGHT PREFIX "
            f"(e.g. --data 0.7 data/a 0.3 data/b){quote}"
        )
    pairs = []
    for w, prefix in zip(items[::2], items[1::2]):
        if not _is_weight(w):
            raise ValueError(
                f"--data: {w!r} is not a weight; a blend is pairs of WEIGHT PREFIX "
                f"(e.g. --data 0.7 data/a 0.3 data/b){quote}"
            )
        weight = float(w)
        if not (math.isfinite(weight) and weight >= 0):
            raise ValueError(
                f"--data: weight {w} of {prefix} must be positive and finite, or 0 to leave "
                f"the part out (weights are relative: e.g. --data 0.7 data/a 0.3 data/b)"
            )
        pairs.append((weight + 0.0, prefix))  # -0.0 is 0
    total = sum(w for w, _ in pairs)
    if not math.isfinite(total):
        raise ValueError(
            f"--data: the weights {' '.join(items[::2])} add up to more than a float holds; "
            f"give smaller weights (they are relative: e.g. --data 0.7 data/a 0.3 data/b)"
        )
    if total == 0:
        raise ValueError(
            f"--data: every weight of the blend is 0 ({' '.join(items[::2])}), so nothing "
            f"would be drawn; give at least one part a positive weight"
        )
    return pairs


def absolute_data(spec):
    """`spec` (a --data value) with every path that names data here made absolute, so that a
    checkpoint's record of it still finds the data from another directory. A single path stays
    a string; a blend becomes a WEIGHT PATH list (its paths may hold spaces)."""

    def absolute(path: str) -> str:
        return os.path.abspath(os.path.expanduser(path)) if _names_data(path) else path

    if spec is None:
        return None
    blend = parse_blend(spec)
    if blend is None:
        return absolute(spec[0] if isinstance(spec, list) else spec)
    items = spec.split() if isinstance(spec, str) else [str(x) for x in spec]
    return [x if i % 2 == 0 else absolute(x) for i, x in enumerate(items)]


def data_paths(spec) -> list[str | None]:
    """The paths of a --data value: a blend's, or the single one ([None] for no --data)."""
    if spec is None:
        return [None]
    blend = parse_blend(spec)
    if blend is not None:
        return [p for _, p in blend]
    return [spec[0] if isinstance(spec, list) else spec]


def blend_indices(
    weights: Sequence[float] | np.ndarray, lengths: Sequence[int], size: int, seed: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index, sample_index) of each of `size` blended samples."""
    w = np.asarray(weights, dtype=np.float64)
    due_parts, which_parts = [], []
    for d, wd in enumerate(w):
        k = np.arange(int(np.ceil(wd * size)) + 1, dtype=np.float64)
        due_parts.append((k + 0.5) / wd)
        which_parts.append(np.full(len(k), d, dtype=np.int64))
    due, which = np.concatenate(due_parts), np.concatenate(which_parts)
    order = np.lexsort((which, due))[:size]  # by due time, then dataset index
    dataset_index = which[order]
    sample_index = np.empty(size, dtype=np.int64)
    for d, n in enumerate(lengths):
        mask = dataset_index == d
        draws = int(mask.sum())
        passes = [np.random.default_rng([seed, d, e]).permutation(n) for e in range(-(-draws // n))]
        sample_index[mask] = np.concatenate(passes)[:draws] if passes else []
    return dataset_index, sample_index


class BlendedDataset:
    """Datasets mixed by weight; as long as all of them together unless `size` is given."""

    #: The order is already shuffled (by `seed`): samplers take it as it is.
    shuffled = True

    def __init__(
        self,
        datasets: Sequence,
        weights: Sequence[float],
        names: Sequence[str],
        seed: int = 0,
        size: int | None = None,
    ):
        if len(datasets) != len(weights) or not datasets:
            raise ValueError("a blend needs one weight per dataset")
        empty = [n for n, d in zip(names, datasets) if len(d) == 0]
        if empty:
            raise ValueError(f"blended dataset {empty[0]} has no samples at this sequence length")
        self.datasets, self.names = list(datasets), list(names)
        self.weights = np.asarray(weights, dtype=np.float64) / float(np.sum(weights))
        self.size = int(size if size is not None else sum(len(d) for d in datasets))
        self.seed = seed
        self.dataset_index, self.sample_index = blend_indices(
            self.weights, [len(d) for d in datasets], self.size, seed
        )
        # the k-th draw of its dataset each sample is, and each dataset's draws per epoch
        self.draws = np.bincount(self.dataset_index, minlength=len(self.datasets))
        self.draw_rank = np.empty(self.size, dtype=np.int64)
        for d in range(len(self.datasets)):
            mask = self.dataset_index == d
            self.draw_rank[mask] = np.arange(int(mask.sum()))
        self._passes: dict[tuple[int, int], np.ndarray] = {}

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int):
        """Sample `i` of the blend; ``i >= len(self)`` is sample ``i % len(self)`` of epoch
        ``i // len(self)``: the same dataset, its draws continuing where the epoch before
        left off (through further seeded permutations, as within an epoch), so a dataset's
        samples left undrawn by one epoch are drawn by the next ones."""
        epoch, j = divmod(int(i), self.size)
        d = int(self.dataset_index[j])
        if epoch == 0:
            return self.datasets[d][int(self.sample_index[j])]
        n = len(self.datasets[d])
        p, r = divmod(epoch * int(self.draws[d]) + int(self.draw_rank[j]), n)
        if (d, p) not in self._passes:
            if len(self._passes) > 64:
                self._passes.clear()
            self._passes[(d, p)] = np.random.default_rng([self.seed, d, p]).permutation(n)
        return self.datasets[d][int(self._passes[(d, p)][r])]

    def proportions(self, indices: np.ndarray | None = None) -> np.ndarray:
        """Share of each dataset among the samples `indices` (default: the whole blend)."""
        which = self.dataset_index if indices is None else self.dataset_index[indices % self.size]
        counts = np.bincount(which, minlength=len(self.datasets))
        return counts / max(1, len(which))

    def describe(self, indices: np.ndarray | None = None) -> str:
        """The blend's line ("blend: the 32 samples drawn: A 0.6875 (weight 0.7000: 22 drawn of
        the part's 1,331 samples), ..."): each part's share of the `n` samples drawn, its
        weight, how many of the `n` it gives and how many samples the part holds (a part drawn
        more times than it holds repeats its samples)."""
        which = self.dataset_index if indices is None else self.dataset_index[indices % self.size]
        drawn = np.bincount(which, minlength=len(self.datasets))
        n = len(which)
        parts = [
            f"{name} {k / max(1, n):.4f} (weight {w:.4f}: {k:,} drawn of the part's {len(d):,} "
            f"samples)"
            for name, k, w, d in zip(self.names, drawn.tolist(), self.weights, self.datasets)
        ]
        return f"blend: the {n:,} samples drawn: " + ", ".join(parts)
