"""HSTU attention for serving over a paged KV cache: ``torch.ops.recompile.hstu_paged_attention``.

Each of ``B`` users has a cached prefix of ``cached_lengths[b]`` tokens whose keys and values sit in pages of
one layer's pools ``k_cache [num_pages, page_size, H, D]``, ``v_cache [num_pages, page_size, H, Dv]`` (page
``page_table[b, i]`` holds positions ``i * page_size ..``), and ``N_b`` new rows ``q, k, v [T, H, *]`` (jagged by
``offsets [B + 1]``): new actions, then ``num_targets[b]`` candidates. ``out [T, H, Dv]`` is, row for row, what
``recompile.hstu_attention`` (causal) gives the new rows of the whole sequence ``prefix + new`` with
``num_targets``: a history row sees the history up to itself, a candidate sees the history and itself, not
the other candidates. Biases as ``hstu_attention``: ``rel_bias`` at ``max_seq_len - 1 + j - i`` over the whole
sequence's positions; ``time_bias`` at the bucket of ``ts_i - ts_j`` with the prefix's timestamps read from
``ts_cache [num_pages, page_size]`` through the same page table.

Only the new rows are computed: work ~ ``N_b * (cached + N_b)`` instead of ``(cached + N_b)^2``. Inference only
(no autograd): the cache holds no graph. Writing the new rows' keys and values into the pools is the cache
manager's job (``recompile.serving``), not the op's: the op mutates nothing.

Kernels: ``reference`` rebuilds each whole sequence and runs ``hstu_attention``'s reference on it (the oracle);
``native`` is the C++ kernel (``runtime/csrc/paged_attention.h``, ``torch.ops.recompile_native.hstu_paged_attention``:
OpenMP over (user, head, query block), keys and values read tile by tile through the page table, f32 / f16 /
bf16); ``cpu`` gathers each user's pages and runs the new rows against them as dense matmuls; ``triton`` runs
one program per core over (query tile, head) items, reading keys through the page table (no time bias: its
``supports`` says so, and the lowering chooses ``native`` or ``cpu`` then).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from hkv.native import unit_stride_rows
from . import jagged_attention_native
from .jagged import check_offsets, jagged_positions
from .jagged_attention import hstu_attention_reference, time_bucket
from .kernels import get_kernel, register_kernel, require

OP = "hstu_paged_attention"


def prefix_rows(page_table: torch.Tensor, cached_lengths: torch.Tensor, page_size: int) -> torch.Tensor:
    """Rows of the flattened pool ``[num_pages * page_size]`` holding each user's cached prefix, user after user."""
    offsets = F.pad(torch.cumsum(cached_lengths.long(), 0), (1, 0))
    users, pos = jagged_positions(offsets, int(offsets[-1]))
    return page_table[users, pos // page_size].long() * page_size + pos % page_size


def user_prefix(cache: torch.Tensor, pages: torch.Tensor, length: int) -> torch.Tensor:
    """One user's first ``length`` cached rows ``[length, ...]`` from its ``pages``."""
    page_size = cache.shape[1]
    return cache[pages[: -(-length // page_size)].long()].flatten(0, 1)[:length]


def time_index(ts_query: torch.Tensor, ts_key: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """``[n, m]`` index into ``time_bias``: ``time_bucket(ts_query[i] - ts_key[j])`` (the log formula: for integer
    timestamps the same buckets as ``relative_time_index``'s search of the bucket edges, and faster here)."""
    return time_bucket(ts_query.view(-1, 1) - ts_key.view(1, -1), num_buckets)


# ---------------------------------------------------------------------------------------------
# Kernels


@register_kernel(OP, "reference")
def _reference(q, k, v, offsets, k_cache, v_cache, page_table, cached_lengths, max_seq_len, alpha, num_targets,
               rel_bias, timestamps, ts_cache, time_bias):
    """Every user's whole sequence (a zero query for the prefix rows) through ``hstu_attention``'s reference."""
    page_size, cached = k_cache.shape[1], cached_lengths.long()
    rows = prefix_rows(page_table, cached, page_size)
    new_lengths = offsets[1:].long() - offsets[:-1].long()
    full_offsets = F.pad(torch.cumsum(cached + new_lengths, 0), (1, 0))
    users, pos = jagged_positions(full_offsets, int(full_offsets[-1]))
    in_prefix = pos < cached[users]
    prefix_start = F.pad(torch.cumsum(cached, 0), (1, 0))[users]
    source = torch.where(in_prefix, prefix_start + pos, rows.numel() + offsets.long()[users] + pos - cached[users])

    def whole(new, pool):
        return torch.cat([pool.flatten(0, 1)[rows], new])[source]

    full_q = torch.cat([q.new_zeros((rows.numel(),) + q.shape[1:]), q])[source]
    full_ts = None if timestamps is None else whole(timestamps.to(ts_cache.dtype), ts_cache)
    out = hstu_attention_reference(full_q, whole(k, k_cache), whole(v, v_cache), full_offsets, max_seq_len, alpha,
                                   True, num_targets, 0, rel_bias, full_ts, time_bias)
    return out[~in_prefix]


def _hankel(rel_bias: torch.Tensor, max_seq_len: int, first: int, rows: int, keys: int) -> torch.Tensor:
    """``[rows, keys]`` view, no copy: ``rel_bias[max_seq_len - 1 + j - i]`` for rows ``i = first ..`` and keys
    ``j = keys - 1 - c`` (column ``c`` is the ``c``-th key from the last): the flipped bias along both diagonals."""
    flipped = rel_bias.flip(0)  # flipped[t] = rel_bias[2 max_seq_len - 2 - t]
    return flipped.as_strided((rows, keys), (1, 1), max_seq_len - keys + first)


@register_kernel(OP, "cpu")
def _cpu(q, k, v, offsets, k_cache, v_cache, page_table, cached_lengths, max_seq_len, alpha, num_targets, rel_bias,
         timestamps, ts_cache, time_bias):
    """User by user, as dense matmuls: the new rows against the history keys (the gathered pages and the new
    history rows) taken last first, so that the relative position bias is a strided view of the flipped bias
    (no index, no copy); the causal mask touches only the new history rows' square; each candidate's own key
    is added as one more term. Time buckets are computed once per distinct query timestamp."""
    out = v.new_empty(v.shape)
    bounds, cached = offsets.tolist(), cached_lengths.tolist()
    targets = [0] * len(cached) if num_targets is None else num_targets.tolist()
    for b, prefix in enumerate(cached):
        s, e = bounds[b], bounds[b + 1]
        if e == s:
            continue
        history = e - s - targets[b]  # new history rows; then the candidates
        end = prefix + history  # the history's length: the keys every candidate sees
        keys = torch.cat([user_prefix(k_cache, page_table[b], prefix), k[s : s + history]]).flip(0)
        values = torch.cat([user_prefix(v_cache, page_table[b], prefix), v[s : s + history]]).flip(0)
        scores = torch.matmul(q[s:e].transpose(0, 1), keys.permute(1, 2, 0))  # [H, N, end], keys last first
        if alpha != 1.0:
            scores.mul_(alpha)
        if rel_bias is not None:
            scores += _hankel(rel_bias.to(scores.dtype), max_seq_len, prefix, e - s, end)
        if time_bias is not None:
            ts_keys = torch.cat([user_prefix(ts_cache, page_table[b], prefix),
                                 timestamps[s : s + history].to(ts_cache.dtype)]).flip(0)
            distinct, which = torch.unique(timestamps[s:e].to(ts_cache.dtype), return_inverse=True)
            scores += time_bias[time_index(distinct, ts_keys, time_bias.numel() - 1)].to(scores.dtype)[which]
        weights = F.silu(scores, inplace=True)
        if history > 1:  # new history row r sees keys up to itself: columns from history - 1 - r on
            r = torch.arange(history, device=q.device)
            weights[:, :history, : history - 1].mul_(r.view(-1, 1) + r[:-1].view(1, -1) >= history - 1)
        attn = torch.matmul(weights, values.transpose(0, 1)).transpose(0, 1)  # [N, H, Dv]
        if targets[b]:
            attn[history:] += _own_key_terms(q[s + history : e], k[s + history : e], v[s + history : e], alpha,
                                             max_seq_len, rel_bias, timestamps, time_bias)
        out[s:e] = attn.mul_(1.0 / max_seq_len)
    return out


def _own_key_terms(q, k, v, alpha, max_seq_len, rel_bias, timestamps, time_bias) -> torch.Tensor:
    """``silu(alpha q_c k_c + bias(c, c)) v_c`` of each candidate ``c``: its attention to its own key."""
    own = (q * k).sum(-1).mul_(alpha)  # [T, H]
    if rel_bias is not None:
        own += rel_bias[max_seq_len - 1].to(own.dtype)
    if time_bias is not None:  # the gap to itself is 0: bucket of 0
        own += time_bias[time_index(timestamps[:1], timestamps[:1], time_bias.numel() - 1)[0, 0]].to(own.dtype)
    return F.silu(own).unsqueeze(-1) * v


def native_supports(q, k, v, k_cache, v_cache, timestamps=None, **_) -> bool | str:
    """``supports`` of the native kernel: CPU tensors of one dtype it is built for (the caches too), integer
    timestamps, and the library loads."""
    if not k_cache.dtype == v_cache.dtype == q.dtype:
        return f"caches of dtypes {k_cache.dtype}, {v_cache.dtype} for {q.dtype} queries: the kernel takes one dtype"
    return jagged_attention_native.supports(q, k, v, timestamps)


def _int64(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.to(torch.int64).contiguous()


@register_kernel(OP, "native", supports=native_supports)
def _native(q, k, v, offsets, k_cache, v_cache, page_table, cached_lengths, max_seq_len, alpha, num_targets,
            rel_bias, timestamps, ts_cache, time_bias):
    require(OP, "native", native_supports(q, k, v, k_cache, v_cache, timestamps))
    pad = jagged_attention_native.VECTOR
    return torch.ops.recompile_native.hstu_paged_attention(
        *(unit_stride_rows(t) for t in (q, k, v)), _int64(offsets), k_cache.contiguous(), v_cache.contiguous(),
        _int64(page_table), _int64(cached_lengths), max_seq_len, alpha, _int64(num_targets),
        None if rel_bias is None else F.pad(rel_bias.detach().float().contiguous(), (0, pad)), _int64(timestamps),
        _int64(ts_cache), None if time_bias is None else time_bias.detach().float().contiguous(),
        None if time_bias is None else jagged_attention_native.bucket_bounds(time_bias.numel() - 1))


def triton_covers(time_bias=None, **_) -> bool | str:
    """``supports`` of the Triton kernel: it takes no time bias (the lowering chooses the ``cpu`` kernel then)."""
    return True if time_bias is None else "a time bias: the Triton kernel takes none"


@register_kernel(OP, "triton", supports=triton_covers)
def _triton(q, k, v, offsets, k_cache, v_cache, page_table, cached_lengths, max_seq_len, alpha, num_targets,
            rel_bias, timestamps, ts_cache, time_bias):
    require(OP, "triton", triton_covers(time_bias))
    from .triton_kernels.paged_attention import hstu_paged_attention_forward

    return hstu_paged_attention_forward(q, k, v, offsets, k_cache, v_cache, page_table, cached_lengths, max_seq_len,
                                        alpha, num_targets, rel_bias)


def hstu_paged_attention_reference(q, k, v, offsets, k_cache, v_cache, page_table, cached_lengths, max_seq_len,
                                   alpha, num_targets=None, rel_bias=None, timestamps=None, ts_cache=None,
                                   time_bias=None):
    return _reference(q, k, v, offsets, k_cache, v_cache, page_table, cached_lengths, max_seq_len, alpha,
                      num_targets, rel_bias, timestamps, ts_cache, time_bias)


# ---------------------------------------------------------------------------------------------
# The op


def _fail(message: str):
    raise ValueError(f"recompile.{OP}: {message}")


def _check(q, k, v, offsets, k_cache, v_cache, page_table, cached_lengths, max_seq_len, num_targets, rel_bias,
           timestamps, ts_cache, time_bias) -> None:
    check_offsets(OP, offsets)
    batch = offsets.numel() - 1
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[:2] != q.shape[:2]:
        _fail(f"q, k must be [total, heads, D] and v [total, heads, Dv] alike, got {tuple(q.shape)}, "
              f"{tuple(k.shape)}, {tuple(v.shape)}")
    if k_cache.dim() != 4 or k_cache.shape[2:] != k.shape[1:] or v_cache.shape[:3] != k_cache.shape[:3] \
            or v_cache.shape[3:] != v.shape[2:]:
        _fail(f"k_cache must be [pages, page_size, heads, D] and v_cache [pages, page_size, heads, Dv] matching k "
              f"{tuple(k.shape)} and v {tuple(v.shape)}, got {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    if page_table.dim() != 2 or page_table.shape[0] != batch or page_table.is_floating_point():
        _fail(f"page_table must be integer [B={batch}, max_pages], got {page_table.dtype} {tuple(page_table.shape)}")
    for name, t in (("cached_lengths", cached_lengths), ("num_targets", num_targets)):
        if t is not None and (t.shape != (batch,) or t.is_floating_point()):
            _fail(f"{name} must be integer [B={batch}], got {t.dtype} {tuple(t.shape)}")
    if (timestamps is None) != (time_bias is None) or (timestamps is None) != (ts_cache is None):
        _fail("timestamps, ts_cache and time_bias come together")
    if ts_cache is not None and ts_cache.shape != k_cache.shape[:2]:
        _fail(f"ts_cache must be [pages, page_size] = {tuple(k_cache.shape[:2])}, got {tuple(ts_cache.shape)}")
    if rel_bias is not None and rel_bias.numel() != 2 * max_seq_len - 1:
        _fail(f"rel_bias must have 2 * max_seq_len - 1 = {2 * max_seq_len - 1} entries, got {rel_bias.numel()}")


def _check_values(offsets, k_cache, page_table, cached_lengths, max_seq_len, rel_bias) -> None:
    """The checks that read the lengths (host syncs): the native kernel makes them itself, in C++."""
    batch = offsets.numel() - 1
    if batch and int(cached_lengths.max()) > page_table.shape[1] * k_cache.shape[1]:
        _fail(f"a cached length ({int(cached_lengths.max())}) is beyond its page table "
              f"({page_table.shape[1]} pages of {k_cache.shape[1]})")
    lengths = cached_lengths + (offsets[1:] - offsets[:-1])
    if rel_bias is not None and batch and int(lengths.max()) > max_seq_len:
        _fail(f"a sequence of {int(lengths.max())} (cached + new) is longer than max_seq_len={max_seq_len}, "
              "beyond the relative position bias")


@torch.library.custom_op("recompile::hstu_paged_attention", mutates_args=())
def hstu_paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, k_cache: torch.Tensor,
    v_cache: torch.Tensor, page_table: torch.Tensor, cached_lengths: torch.Tensor, max_seq_len: int, alpha: float,
    num_targets: Optional[torch.Tensor] = None, rel_bias: Optional[torch.Tensor] = None,
    timestamps: Optional[torch.Tensor] = None, ts_cache: Optional[torch.Tensor] = None,
    time_bias: Optional[torch.Tensor] = None, impl: str = "reference",
) -> torch.Tensor:
    _check(q, k, v, offsets, k_cache, v_cache, page_table, cached_lengths, max_seq_len, num_targets, rel_bias,
           timestamps, ts_cache, time_bias)
    if impl != "native":
        _check_values(offsets, k_cache, page_table, cached_lengths, max_seq_len, rel_bias)
    return get_kernel(OP, impl)(q, k, v, offsets, k_cache, v_cache, page_table, cached_lengths, max_seq_len, alpha,
                                num_targets, rel_bias, timestamps, ts_cache, time_bias)


@hstu_paged_attention.register_fake
def _(q, k, v, offsets, k_cache, v_cache, page_table, cached_lengths, max_seq_len, alpha, num_targets=None,
      rel_bias=None, timestamps=None, ts_cache=None, time_bias=None, impl="reference"):
    return torch.empty_like(v)
