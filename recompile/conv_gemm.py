"""conv_gemm: a one-channel convolution whose kernel spans its input's width or height as the GEMM of its windows,
in every graph rec_ascend hands to Inductor (a step before Inductor, like ``dot_linear``, not a rec pass:
it finds no region and runs on the captured graph too).

Pattern -> replacement -> why, in training graphs:

- ``conv2d(x, w, b)`` with ``x`` [B, 1, H, W], ``w`` [C, 1, kh, kw] where ``kw == W`` or ``kh == H`` (static),
  stride 1, no padding, no dilation, one group, floating point -> ``linear(windows, w.reshape(C, kh * kw), b)``,
  ``windows`` [B, Ph * Pw, kh * kw] its im2col (each output position's window as a row: ``x.unfold(2, kh, 1)``
  for a full-width kernel, a view of ``x`` for one of height 1 or H), permuted back to [B, C, Ph, Pw] and made
  contiguous, as the convolution's output is. A convolution over a sequence's embedding matrix, as RecBole's
  Caser writes them (``Conv2d(1, n_h, (i, d))`` for each height i, and ``Conv2d(1, n_v, (L, 1))``), is a small
  GEMM that ATen runs as a convolution with one input channel, forward through oneDNN and backward through its
  slow path: Caser's loss at batch 2048 (L = 12, d = 8, two channels: the corpus's sizes) spent 64% of its step in
  ``convolution_backward`` (CPU time, one thread). As GEMMs, which Inductor fuses around (the windows' copy,
  ``unfold``'s backward, the bias, the activation after), its twelve horizontal convolutions with their ReLU and
  max-pool went from 97 to 23 ms forward and backward, the vertical one from 2.9 to 1.1 ms.

Other convolutions are left as they are: a kernel narrower than its input both ways repeats each input element
kh * kw times in the windows.

Inference graphs take another form, as the one above cost two C++ kernels per convolution (the windows' copy: a
GEMM's operand; the epilogue after the GEMM, a buffer of its own), one C++ build each, which an inference graph's
short cold compile cannot carry (Caser's full sort, 13 convolutions: 17.4 s CPU against plain Inductor's 7.1 s,
2.5x). There the convolutions as wide as one input share its windows, and a one-column one is a sum:

- ``conv2d(x, w_i, b_i)`` for each i, ``x`` [B, 1, H, W], ``w_i`` [C_i, 1, k_i, W] -> with K the largest k_i and
  ``windows`` [P, B, K * W] the windows of K rows of ``x`` extended by its first K - min(k_i) rows, position-major (P =
  H - min(k_i) + 1 positions; only dropped positions read those rows; ``F.pad`` would specialize a dynamic batch),
  copied once (``contiguous``), each convolution ``linear(windows[:H - k_i + 1, :, :k_i * W].reshape(-1, k_i * W),
  w_i.reshape(C_i, k_i * W), b_i)``: its kernel's rows are the first k_i of each window and its positions the first
  H - k_i + 1, so the GEMM reads a block of the shared windows' rows, a column slice of each (a strided operand, no
  copy), and its output, permuted to [B, C_i, H - k_i + 1, 1], is the convolution's. Inductor fuses the windows' one
  copy into the kernel that makes ``x`` (Caser: its embedding lookup), runs the GEMMs as extern calls and the permute
  where the convolution's output was read (Caser: its ReLU and max-pool): as many C++ kernels as plain Inductor
  generates (4 in Caser's full sort). The windows were batch-major, [B * P, K * W], until the fourteenth stop: every
  GEMM then ran over all P positions of every row, 2.6x the products Caser's twelve kernels need (936 against 364
  windows' rows of 8 per sequence), and RecBole Caser's full sort at batch 2048 ran 0.91-0.96x plain Inductor's
  (docs/corpus.md).
- ``conv2d(x, w, b)``, ``w`` [C, 1, H, 1] one column as high as ``x`` [B, 1, H, W] (Caser's vertical convolution)
  -> ``sum(x * w.permute(1, 0, 2, 3), 2, keepdim=True) + b``: a reduction over H that Inductor generates inline in
  the kernel reading the output (Caser: the max-pools' and the ``cat``), where ATen ran a oneDNN convolution with one
  input channel (0.9-1.4 ms of the step at batch 2048, under load).

Measured and not kept (cold compile, CPU s, against 7.8 for the convolutions): one GEMM of the rows ``x`` [B * H, W]
against all kernels' rows, each output a sum of shifted slices of it (15.6; the sums fused into the max-pool's unrolled
window make a large kernel), the same with the outputs stacked (16.1), with zero-padded kernels and a sum over diagonals
(15.8), one GEMM of the shared windows against the zero-padded kernels (14.7: the kernels' cat is a large kernel), a
GEMM of the rows per convolution (26.8: each sum a kernel).

The numbers do not change but for the summation order of each output.
"""
from __future__ import annotations

import functools

import torch
import torch.fx as fx

from recompile.passes.utils import arg, is_call, is_training, tensor_meta
from recompile.pipeline import call_before, rewrite_each

CONV2D = torch.conv2d  # F.conv2d and nn.Conv2d calls, as Dynamo records them


def _one(value, n: int) -> bool:
    """``value`` is the int ``n`` or a pair of it (a convolution's stride, padding or dilation argument)."""
    return value == n or (isinstance(value, (tuple, list)) and list(value) == [n, n])


def _kernel(node: fx.Node) -> tuple[int, int] | None:
    """``(kh, kw)`` where ``node`` is a ``conv2d`` the replacement computes as is: one input channel, a kernel as
    wide or as high as its input, stride 1, no padding or dilation, one group, floating point."""
    if not is_call(node, CONV2D):
        return None
    x, w = tensor_meta(arg(node, 0, "input")), tensor_meta(arg(node, 1, "weight"))
    bias = arg(node, 2, "bias")
    if x is None or w is None or x.dim() != 4 or w.dim() != 4 or x.dtype != w.dtype or not w.dtype.is_floating_point:
        return None
    if not (_one(arg(node, 3, "stride", 1), 1) and _one(arg(node, 5, "dilation", 1), 1)
            and arg(node, 6, "groups", 1) == 1):
        return None
    padding = arg(node, 4, "padding", 0)
    if not (padding == "valid" or _one(padding, 0)) or (bias is not None and tensor_meta(bias) is None):
        return None
    (_, channels, height, width), (_, _, kh, kw) = x.shape, w.shape
    if not all(isinstance(s, int) for s in (channels, height, width, kh, kw)) or channels != 1 or w.shape[1] != 1:
        return None
    return (kh, kw) if kw == width or kh == height else None


def _full_width(node: fx.Node) -> tuple[int, int] | None:
    """``_kernel(node)`` where that kernel is as wide as its input."""
    kernel = _kernel(node)
    return kernel if kernel is not None and kernel[1] == tensor_meta(arg(node, 0, "input")).shape[3] else None


def _column(node: fx.Node) -> tuple[int, int] | None:
    """``_kernel(node)`` where that kernel is one column as high as its input, which is wider than one column."""
    kernel = _kernel(node)
    return kernel if kernel is not None and kernel[1] == 1 and _full_width(node) is None else None


def convs_as_gemms(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with each one-channel, full-span convolution as the GEMM of its windows (``rewrite_each``); in a graph
    that is not a training graph, each full-width one as a GEMM of its input's shared windows, each one-column one
    as a weighted sum of its input's rows."""
    if is_training(gm):
        return rewrite_each(gm, _kernel, _windows_gemm)
    gm = rewrite_each(gm, _full_width, functools.partial(_shared_windows_gemm, {}))
    return rewrite_each(gm, _column, _column_sum)


def _windows(graph: fx.Graph, conv: fx.Node, x: fx.Node, kh: int, kw: int) -> fx.Node:
    """``x``'s windows [B, positions, kh * kw] (each in ``w``'s order), before ``conv``: an ``unfold`` only along a
    dim the kernel spans neither one nor all of, which needs none (Inductor corrupts the heap compiling ``unfold``
    of one element and its backward, torch 2.13 CPU: ``x.unfold(3, 1, 1)`` of a [16, 1, 6, 4] input)."""
    height, width = tensor_meta(x).shape[2:]
    positions = (height - kh + 1) * (width - kw + 1)
    if kw == width and kh not in (1, height):
        x = call_before(graph, torch.transpose, (call_before(graph, torch.Tensor.unfold, (x, 2, kh, 1), conv), 3, 4),
                        conv)
    elif kw != width and kw != 1:
        x = call_before(graph, torch.permute, (call_before(graph, torch.Tensor.unfold, (x, 3, kw, 1), conv),
                                               (0, 1, 3, 2, 4)), conv)
    elif kw != width:  # kw == 1, kh == height: each column is a window
        x = call_before(graph, torch.transpose, (x, 2, 3), conv)
    return call_before(graph, torch.reshape, (x, (-1, positions, kh * kw)), conv)


def _windows_gemm(graph: fx.Graph, conv: fx.Node, kernel: tuple[int, int]) -> fx.Node:
    """The nodes, before ``conv``, of its output computed as ``linear`` of its windows."""
    (kh, kw), (x, w, bias) = kernel, (arg(conv, 0, "input"), arg(conv, 1, "weight"), arg(conv, 2, "bias"))
    channels = tensor_meta(w).shape[0]
    rows, columns = tensor_meta(conv).shape[2:]
    flat = call_before(graph, torch.reshape, (w, (channels, kh * kw)), conv)
    out = call_before(graph, torch._C._nn.linear, (_windows(graph, conv, x, kh, kw), flat, bias), conv)
    out = call_before(graph, torch.permute, (out, (0, 2, 1)), conv)
    out = call_before(graph, torch.reshape, (out, (-1, channels, rows, columns)), conv)
    return call_before(graph, torch.Tensor.contiguous, (out,), conv)


def _shared_windows(graph: fx.Graph, conv: fx.Node, x: fx.Node) -> fx.Node:
    """The windows [P, B, K * W] of K rows shared by the full-width convolutions that read ``x``, position-major
    (K the tallest kernel, ``x`` extended by its first K - k rows for k the shortest one: only positions no
    convolution keeps read them), before ``conv``."""
    heights = [found[0] for user in x.users if (found := _full_width(user)) is not None]
    (height, width), tallest, pad = tensor_meta(x).shape[2:], max(heights), max(heights) - min(heights)
    if pad:
        x = call_before(graph, torch.cat, ((x, call_before(graph, torch.narrow, (x, 2, 0, pad), conv)), 2), conv)
    if tallest not in (1, height + pad):  # no unfold of one element (see ``_windows``)
        x = call_before(graph, torch.Tensor.unfold, (x, 2, tallest, 1), conv)  # [B, 1, P, W, K]
        x = call_before(graph, torch.permute, (x, (2, 0, 1, 4, 3)), conv)
    elif tallest == 1:  # each row is a window
        x = call_before(graph, torch.permute, (x, (2, 0, 1, 3)), conv)
    x = call_before(graph, torch.reshape, (x, (height + pad - tallest + 1, -1, tallest * width)), conv)
    # The reshape is an overlapping view of ``x``: copied once here, else Inductor copies it for each GEMM.
    return call_before(graph, torch.Tensor.contiguous, (x,), conv)


def _shared_windows_gemm(shared: dict, graph: fx.Graph, conv: fx.Node, kernel: tuple[int, int]) -> fx.Node:
    """The nodes, before ``conv``, of its output as ``linear`` of the first ``kh`` rows of its positions' windows in
    its input's shared windows (made before the first convolution that reads that input, kept in ``shared``)."""
    (kh, width), (x, w, bias) = kernel, (arg(conv, 0, "input"), arg(conv, 1, "weight"), arg(conv, 2, "bias"))
    if x not in shared:
        shared[x] = _shared_windows(graph, conv, x)
    positions, channels = tensor_meta(conv).shape[2], tensor_meta(w).shape[0]
    rows = call_before(graph, torch.narrow, (shared[x], 0, 0, positions), conv)
    rows = call_before(graph, torch.narrow, (rows, 2, 0, kh * width), conv)
    rows = call_before(graph, torch.reshape, (rows, (-1, kh * width)), conv)  # a view: positions, then batch
    flat = call_before(graph, torch.reshape, (w, (channels, kh * width)), conv)
    out = call_before(graph, torch._C._nn.linear, (rows, flat, bias), conv)
    out = call_before(graph, torch.reshape, (out, (positions, -1, channels)), conv)
    out = call_before(graph, torch.unsqueeze, (call_before(graph, torch.permute, (out, (1, 2, 0)), conv), 3), conv)
    return call_before(graph, torch.Tensor.contiguous, (out,), conv)


def _column_sum(graph: fx.Graph, conv: fx.Node, kernel: tuple[int, int]) -> fx.Node:
    """The nodes, before ``conv``, of its output as the sum over its input's H rows of each row times its weight in
    each channel: [B, 1, H, W] x [1, C, H, 1] summed over H, a reduction Inductor generates inline."""
    x, w, bias = arg(conv, 0, "input"), arg(conv, 1, "weight"), arg(conv, 2, "bias")
    out = call_before(graph, torch.mul, (x, call_before(graph, torch.permute, (w, (1, 0, 2, 3)), conv)), conv)
    out = call_before(graph, torch.sum, (out, 2, True), conv)
    if bias is None:
        return out
    return call_before(graph, torch.add, (out, call_before(graph, torch.reshape, (bias, (1, -1, 1, 1)), conv)), conv)
