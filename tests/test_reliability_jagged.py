"""Jagged ops never trust their offsets: one shared check (runtime.jagged.checked_offsets) runs before every
kernel, with the embedding ops' bounds-check modes. Every kernel of every op gives the same outcome on the same
malformed offsets: the same named error ("fatal"), or the same result on the same repaired offsets
("warning" / "ignore"). The hypothesis fuzz of this (and of the other op families) is test_reliability_fuzz."""
from __future__ import annotations

import warnings

import pytest
import torch

from recompile.runtime.jagged import checked_offsets
from recompile.runtime.kernels import KERNELS

ops = torch.ops.recompile
D = 3


def make_args(op: str, offsets: torch.Tensor, total: int, max_len: int, seed: int = 0):
    """The op's arguments around ``offsets`` (values of ``total`` rows, maximum length ``max_len``)."""
    gen = torch.Generator().manual_seed(seed)
    batch = offsets.numel() - 1

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    qkv = [randn(total, 1, 4) for _ in range(3)]
    return {
        "jagged_to_padded_dense": lambda: (randn(total, D), offsets, max_len, 0.5),
        "dense_to_jagged": lambda: (randn(batch, max_len, D), offsets, total),
        "jagged_dense_elementwise_add": lambda: (randn(total, D), offsets, randn(batch, max_len, D)),
        "jagged_dense_elementwise_mul": lambda: (randn(total, D), offsets, randn(batch, max_len, D)),
        "jagged_softmax": lambda: (randn(total, D), offsets, max_len),
        "jagged_jagged_bmm": lambda: (randn(total, D), randn(total, 2), offsets, max_len),
        "jagged_dense_bmm": lambda: (randn(total, D), offsets, randn(batch, D, 2), max_len),
        "hstu_attention": lambda: (*qkv, offsets, max_len, 0.5),
        "jagged_softmax_attention": lambda: (*qkv, offsets, 0.5),
        "jagged_within": lambda: (randn(total, D), offsets, max_len),
    }[op]()


JAGGED_OPS = ("jagged_to_padded_dense", "dense_to_jagged", "jagged_dense_elementwise_add",
              "jagged_dense_elementwise_mul", "jagged_softmax", "jagged_jagged_bmm", "jagged_dense_bmm",
              "hstu_attention", "jagged_softmax_attention", "jagged_within")
# Ops whose maximum length must cover the longest sequence (the others cut sequences at it, as FBGEMM).
COVERING = {"hstu_attention": "max_seq_len", "jagged_within": "padded length"}


def kernels(op: str) -> list[str]:
    return sorted(KERNELS[op])


def outcome(op: str, args, impl: str, mode: str):
    """("error", message) or ("ok", result, warned) of one call."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = getattr(ops, op)(*args, impl=impl, bounds_check=mode)
        except (ValueError, IndexError, RuntimeError) as exc:
            return ("error", f"{type(exc).__name__}: {exc}")
    return ("ok", result, any("recompile." in str(w.message) for w in caught))


def same_outcome(op: str, args, mode: str):
    """The outcome every kernel of ``op`` gives (asserting they agree), with the kernel names."""
    results = {impl: outcome(op, args, impl, mode) for impl in kernels(op)}
    first_impl, first = next(iter(results.items()))
    for impl, got in results.items():
        assert got[0] == first[0], f"{op}: kernel {impl} gives {got[:2]!r}, kernel {first_impl} {first[:2]!r}"
        if got[0] == "error":
            assert got[1] == first[1], f"{op}: kernel {impl} raises {got[1]!r}, kernel {first_impl} {first[1]!r}"
        else:
            torch.testing.assert_close(got[1], first[1], rtol=1e-4, atol=1e-5, msg=f"{op}: kernel {impl} vs {first_impl}")
            assert got[2] == first[2]
    return first


def well_formed(offsets: list[int], total: int) -> bool:
    return offsets[0] == 0 and all(b >= a for a, b in zip(offsets, offsets[1:])) and offsets[-1] == total


def repaired(offsets: list[int], total: int) -> list[int]:
    fixed, top = [0], 0
    for o in offsets[1:]:
        top = max(top, min(max(o, 0), total))
        fixed.append(top)
    fixed[-1] = total
    return fixed


def check_call(op: str, offsets: list[int], total: int, max_len: int, mode: str, dtype=torch.int64, seed: int = 0):
    """Every kernel agrees, and the outcome is the contract's: a named error for malformed offsets ("fatal"),
    else the result on the repaired offsets (with a warning for "warning"); a sequence longer than a covering
    maximum length is always an error."""
    args = make_args(op, torch.tensor(offsets, dtype=dtype), total, max_len, seed)
    got = same_outcome(op, args, mode)
    good = well_formed(offsets, total)
    fixed = offsets if good else repaired(offsets, total)
    too_long = op in COVERING and max(b - a for a, b in zip(fixed, fixed[1:])) > max_len
    if not good and mode == "fatal":
        assert got[0] == "error" and f"recompile.{op}: offsets must start at 0" in got[1], got
        return got
    if too_long:
        assert got[0] == "error" and f"recompile.{op}:" in got[1] and COVERING[op] in got[1], got
        return got
    assert got[0] == "ok", got
    assert got[2] == (not good and mode == "warning")
    if not good:
        clean = make_args(op, torch.tensor(fixed, dtype=dtype), total, max_len, seed)
        torch.testing.assert_close(got[1], getattr(ops, op)(*clean, impl="reference"), rtol=1e-4, atol=1e-5)
    return got


MALFORMED = {
    "first not 0": ([1, 3, 5], 5),
    "decreasing": ([0, 4, 2, 5], 5),
    "last short": ([0, 2, 4], 5),
    "last long": ([0, 2, 6], 5),
    "negative": ([0, -2, 5], 5),
}


@pytest.mark.parametrize("op", JAGGED_OPS)
@pytest.mark.parametrize("mode", ["fatal", "warning", "ignore"])
def test_malformed_offsets_give_one_outcome_on_every_kernel(op, mode):
    for name, (offsets, total) in MALFORMED.items():
        check_call(op, offsets, total, 4, mode)
    check_call(op, [0, 2, 2, 5], 5, 4, mode)  # well formed, with an empty sequence


def test_errors_name_the_op_and_the_argument():
    with pytest.raises(ValueError, match=r"recompile.jagged_softmax: offsets must start at 0, be non-decreasing and "
                                         r"end at 5 \(the values' length\); offsets\[2\] = 2 < \[1\] = 4"):
        ops.jagged_softmax(torch.randn(5, 2), torch.tensor([0, 4, 2, 5]), 4)
    with pytest.raises(ValueError, match="bounds_check 'loud' is not one of"):
        ops.jagged_softmax(torch.randn(5, 2), torch.tensor([0, 5]), 4, bounds_check="loud")


def test_hstu_attention_rejects_max_seq_len_below_the_longest_sequence():
    q = torch.randn(7, 1, 4)
    for impl in kernels("hstu_attention"):
        with pytest.raises(ValueError, match="a sequence has 5 positions, longer than max_seq_len = 4"):
            ops.hstu_attention(q, q, q, torch.tensor([0, 2, 7]), 4, 0.5, impl=impl)


def test_the_check_is_one_function_with_no_sync_in_ignore_mode():
    offsets = torch.tensor([3, 1, 9], dtype=torch.int32)
    fixed = checked_offsets("op", offsets, 6, "ignore")
    assert fixed.dtype == torch.int32 and fixed.tolist() == [0, 1, 6]
    assert checked_offsets("op", torch.tensor([0, 2, 6]), 6).tolist() == [0, 2, 6]


def test_compiled_graph_keeps_the_check_in_the_op():
    def f(values, offsets):
        return ops.jagged_to_padded_dense(values, offsets, 4, 0.0, "cpu").sum(1)

    compiled = torch.compile(f, fullgraph=True, backend="eager")
    values = torch.randn(5, 2)
    torch.testing.assert_close(compiled(values, torch.tensor([0, 2, 5])), f(values, torch.tensor([0, 2, 5])))
    with pytest.raises(ValueError, match="jagged_to_padded_dense: offsets must start at 0"):
        compiled(values, torch.tensor([0, 3, 2]))


def test_backward_through_repaired_offsets_matches_the_forward():
    values = torch.randn(5, D, requires_grad=True)
    bad, fixed = torch.tensor([0, 3, 2, 7]), torch.tensor([0, 3, 3, 5])
    with pytest.warns(UserWarning, match="jagged_softmax: offsets must"):
        out = ops.jagged_softmax(values, bad, 4, impl="cpu", bounds_check="warning")
    (grad,) = torch.autograd.grad(out.square().sum(), values)
    ref = ops.jagged_softmax(values, fixed, 4, impl="reference")
    (ref_grad,) = torch.autograd.grad(ref.square().sum(), values)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(grad, ref_grad)
