"""Data: MovieLens ratings (real, with timestamps), leave-one-out splits and batches, Criteo-shaped synthetic data.

- ``ml-100k`` is read from the file the ``recbole==1.2.1`` wheel ships (found by path, recbole is never
  imported); MovieLens-1M / 20M come from GroupLens's ``ratings.dat`` / ``ratings.csv`` given as ``path``.
- Item ids are remapped to 1..N in order of first appearance in the file (0 is padding); user ids to 0..U-1.
- Leave-one-out by timestamp: per user, the last interaction is the test target, the one before it the
  validation target, the rest is training history.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import numpy as np
import torch

ML100K = "ml-100k"
SYNTHETIC_NOTE = "synthetic data (Criteo-shaped; not Criteo)"


def ml100k_path() -> str:
    spec = importlib.util.find_spec("recbole")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "MovieLens-100k is read from the recbole==1.2.1 wheel: pip install --no-deps recbole==1.2.1 "
            "(or pass --data-path to a GroupLens ratings.dat / ratings.csv)"
        )
    path = os.path.join(os.path.dirname(spec.origin), "dataset_example", "ml-100k", "ml-100k.inter")
    if not os.path.exists(path):
        raise FileNotFoundError(f"MovieLens-100k file missing from the recbole wheel: {path}")
    return path


@dataclass
class Ratings:
    """Interactions with remapped ids: users in 0..num_users-1, items in 1..num_items."""

    users: np.ndarray
    items: np.ndarray
    timestamps: np.ndarray
    num_users: int
    num_items: int
    source: str

    def __len__(self) -> int:
        return len(self.users)


def _read_table(path: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(user, item, timestamp) columns of a recbole .inter, GroupLens ratings.dat or ratings.csv file."""
    name = os.path.basename(path)
    if name.endswith(".inter"):
        raw = np.loadtxt(path, delimiter="\t", skiprows=1, dtype=np.int64, usecols=(0, 1, 3))
    elif name.endswith(".dat"):
        with open(path, encoding="latin-1") as f:
            raw = np.array([line.split("::") for line in f if line.strip()], dtype=np.int64)[:, [0, 1, 3]]
    elif name.endswith(".csv"):
        raw = np.loadtxt(path, delimiter=",", skiprows=1, dtype=np.float64, usecols=(0, 1, 3)).astype(np.int64)
    else:
        raise ValueError(f"unknown ratings file format {path!r}: expected .inter, ratings.dat or ratings.csv")
    if raw.ndim != 2 or raw.shape[0] == 0:
        raise ValueError(f"no ratings read from {path!r}")
    return raw[:, 0], raw[:, 1], raw[:, 2]


def load_ratings(data: str = ML100K, path: str | None = None) -> Ratings:
    if path is None:
        if data != ML100K:
            raise ValueError(f"dataset {data!r} needs --data-path to its GroupLens ratings.dat / ratings.csv")
        path = ml100k_path()
    if not os.path.exists(path):
        raise FileNotFoundError(f"ratings file not found: {path}")
    users, items, timestamps = _read_table(path)
    _, first = np.unique(items, return_index=True)
    order = np.sort(first)
    item_ids = {raw: i + 1 for i, raw in enumerate(items[order])}
    user_raw, user_idx = np.unique(users, return_inverse=True)
    mapped = np.fromiter((item_ids[i] for i in items), dtype=np.int64, count=len(items))
    return Ratings(user_idx.astype(np.int64), mapped, timestamps, len(user_raw), len(item_ids), path)


@dataclass
class UserSequences:
    """Per-user items and timestamps sorted by time (ties keep file order)."""

    items: list[np.ndarray]
    timestamps: list[np.ndarray]
    num_items: int

    @classmethod
    def from_ratings(cls, ratings: Ratings) -> "UserSequences":
        order = np.lexsort((np.arange(len(ratings)), ratings.timestamps, ratings.users))
        users = ratings.users[order]
        bounds = np.flatnonzero(np.diff(users)) + 1
        items = np.split(ratings.items[order], bounds)
        times = np.split(ratings.timestamps[order], bounds)
        return cls(items, times, ratings.num_items)

    def __len__(self) -> int:
        return len(self.items)


EVAL_SPLITS = ("valid", "test")


@dataclass
class LeaveOneOut:
    """train: history without its last two items; valid/test: (history before target, target)."""

    train: UserSequences
    valid_history: UserSequences
    test_history: UserSequences
    valid_targets: np.ndarray
    test_targets: np.ndarray

    @property
    def num_items(self) -> int:
        return self.train.num_items

    def held_out(self, which: str) -> tuple[UserSequences, np.ndarray]:
        """(histories, targets) of the ``"valid"`` (second-to-last) or ``"test"`` (last) item of every user."""
        if which not in EVAL_SPLITS:
            raise ValueError(f"held-out split {which!r}; valid values: {', '.join(EVAL_SPLITS)}")
        return (self.valid_history, self.valid_targets) if which == "valid" else (self.test_history, self.test_targets)


def leave_one_out(ratings: Ratings) -> LeaveOneOut:
    seqs = UserSequences.from_ratings(ratings)
    short = [u for u, s in enumerate(seqs.items) if len(s) < 3]
    if short:
        raise ValueError(f"leave-one-out needs 3+ interactions per user; users {short[:5]} have fewer")

    def cut(end: int) -> UserSequences:
        return UserSequences([s[:end] for s in seqs.items], [t[:end] for t in seqs.timestamps], seqs.num_items)

    return LeaveOneOut(
        train=cut(-2), valid_history=cut(-2), test_history=cut(-1),
        valid_targets=np.array([s[-2] for s in seqs.items]), test_targets=np.array([s[-1] for s in seqs.items]),
    )


def training_windows(train: UserSequences, max_len: int) -> UserSequences:
    """Cut each history into windows of max_len + 1 items, overlapping by one, the most recent window last."""
    items, times = [], []
    for seq, ts in zip(train.items, train.timestamps):
        for end in range(len(seq), 1, -max_len):
            start = max(0, end - max_len - 1)
            items.append(seq[start:end])
            times.append(ts[start:end])
    return UserSequences(items, times, train.num_items)


def sequence_inputs(items: list[np.ndarray], times: list[np.ndarray], fmt: str, max_len: int):
    """Model inputs for histories (each <= max_len): jagged (ids, timestamps, lengths) or padded (ids [B, L],)."""
    lengths = torch.tensor([len(s) for s in items], dtype=torch.int64)
    if fmt == "jagged":
        return torch.from_numpy(np.concatenate(items)), torch.from_numpy(np.concatenate(times)), lengths
    if fmt == "padded":
        padded = torch.zeros(len(items), max_len, dtype=torch.int64)
        for row, seq in enumerate(items):
            padded[row, : len(seq)] = torch.from_numpy(seq)
        return (padded,)
    raise ValueError(f"unknown sequence input format {fmt!r}: expected 'jagged' or 'padded'")


def last_positions(lengths: torch.Tensor, fmt: str, max_len: int) -> torch.Tensor:
    """Flat index of each history's last position in the encoder's output rows."""
    if fmt == "jagged":
        return torch.cumsum(lengths, 0) - 1
    return torch.arange(len(lengths)) * max_len + lengths - 1


def next_item_batch(windows: UserSequences, rows: np.ndarray, fmt: str, max_len: int):
    """(inputs, targets) for windows[rows]: inputs are all items but the last, targets the items one step later."""
    items = [windows.items[r][:-1] for r in rows]
    times = [windows.timestamps[r][:-1] for r in rows]
    targets = sequence_inputs([windows.items[r][1:] for r in rows], times, fmt, max_len)[0]
    return sequence_inputs(items, times, fmt, max_len), targets


def history_inputs(history: UserSequences, rows: np.ndarray, fmt: str, max_len: int):
    """(inputs, last positions) for the most recent max_len items of each user's history."""
    items = [history.items[r][-max_len:] for r in rows]
    times = [history.timestamps[r][-max_len:] for r in rows]
    lengths = torch.tensor([len(s) for s in items], dtype=torch.int64)
    return sequence_inputs(items, times, fmt, max_len), last_positions(lengths, fmt, max_len)


def sample_negatives(pool: torch.Tensor, num_in_batch: int, num_items: int, num_sampled: int,
                     generator: torch.Generator) -> torch.Tensor:
    """In-batch negatives (a random subset of ``pool``, the batch's targets) followed by uniform item ids."""
    pool = pool[pool > 0]
    in_batch = pool[torch.randint(0, len(pool), (num_in_batch,), generator=generator)]
    return torch.cat([in_batch, torch.randint(1, num_items + 1, (num_sampled,), generator=generator)])


@dataclass
class UserItemPairs:
    """Two-tower training pairs: each training interaction with the user's previous items as history."""

    users: torch.Tensor
    items: torch.Tensor
    history: list[np.ndarray]


def user_item_pairs(train: UserSequences, history_len: int) -> UserItemPairs:
    users, items, history = [], [], []
    for user, seq in enumerate(train.items):
        for i in range(1, len(seq)):
            users.append(user)
            items.append(seq[i])
            history.append(seq[max(0, i - history_len):i])
    return UserItemPairs(torch.tensor(users), torch.tensor(np.array(items)), history)


def bags(histories: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """EmbeddingBag (indices, offsets) for a list of id arrays."""
    lengths = torch.tensor([len(h) for h in histories], dtype=torch.int64)
    indices = torch.from_numpy(np.concatenate(histories).astype(np.int64))
    return indices, torch.cumsum(lengths, 0) - lengths


def batches(n: int, batch_size: int, generator: torch.Generator | None = None):
    """Row index arrays of size batch_size (the last one smaller); shuffled when a generator is given."""
    order = torch.randperm(n, generator=generator).numpy() if generator is not None else np.arange(n)
    for start in range(0, n, batch_size):
        yield order[start:start + batch_size]


@dataclass
class CTRData:
    """Rows of dense features, one bag of ids per sparse table, and 0/1 labels."""

    dense: torch.Tensor
    values: list[torch.Tensor]
    offsets: list[torch.Tensor]  # [n + 1] each: bag i is values[t][offsets[t][i]:offsets[t][i + 1]]
    labels: torch.Tensor
    note: str = SYNTHETIC_NOTE

    def __len__(self) -> int:
        return len(self.labels)

    def batch(self, rows: np.ndarray):
        """(dense, indices, offsets, labels) for rows, in the input format of models.dlrm / models.ctr."""
        rows_t = torch.from_numpy(np.asarray(rows))
        indices, offsets = [], []
        for values, offs in zip(self.values, self.offsets):
            starts, ends = offs[rows_t], offs[rows_t + 1]
            lengths = ends - starts
            index = torch.repeat_interleave(starts - (torch.cumsum(lengths, 0) - lengths), lengths)
            indices.append(values[index + torch.arange(int(lengths.sum()))])
            offsets.append(torch.cumsum(lengths, 0) - lengths)
        return self.dense[rows_t], indices, offsets, self.labels[rows_t]


def power_law_ids(rows: int, count: int, alpha: float, generator: torch.Generator) -> torch.Tensor:
    """``count`` ids in [0, rows) with P(id = k) proportional to (k + 1) ** -alpha."""
    probs = torch.arange(1, rows + 1, dtype=torch.float64).pow(-alpha)
    return torch.multinomial(probs / probs.sum(), count, replacement=True, generator=generator)


def criteo_synthetic(n: int, table_rows: list[int], num_dense: int = 13, max_ids_per_bag: int = 1,
                     alpha: float = 1.05, seed: int = 0) -> CTRData:
    """Criteo-shaped synthetic rows: dense features, power-law ids, labels from a hidden logistic model.

    The hidden model has a weight per dense feature, a weight per (table, id) and a low-rank interaction of
    per-id factors, so a CTR model can learn it and AUC is meaningful.
    """
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(n, num_dense, generator=g)
    logit = dense @ (torch.randn(num_dense, generator=g) * 0.3)
    factors = torch.zeros(n, 4)
    values, offsets = [], []
    for rows in table_rows:
        lengths = torch.randint(1, max_ids_per_bag + 1, (n,), generator=g)
        ids = power_law_ids(rows, int(lengths.sum()), alpha, g)
        bag = torch.repeat_interleave(torch.arange(n), lengths)
        weight, factor = torch.randn(rows, generator=g) * 0.5, torch.randn(rows, 4, generator=g) * 0.5
        logit = logit.index_add(0, bag, weight[ids])
        factors = factors.index_add(0, bag, factor[ids])
        values.append(ids)
        offsets.append(torch.nn.functional.pad(torch.cumsum(lengths, 0), (1, 0)))
    logit = logit + 0.5 * factors.pow(2).sum(1) - 0.5 * factors.pow(2).sum(1).mean()
    logit = (logit - logit.mean()) / logit.std() * 1.5 - 1.0
    labels = torch.bernoulli(torch.sigmoid(logit), generator=g)
    return CTRData(dense, values, offsets, labels)
