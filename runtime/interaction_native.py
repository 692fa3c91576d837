"""The native CPU kernels of the interaction ops (``csrc/interaction.h``, the C++ ops
``torch.ops.recompile_native.dot_interaction[_backward]``, ``{cross_epilogue,fm_second_order,vector_cross}_{fwd,bwd}``
and ``cross_{stack,mixture}_fwd``).

Each function makes one op call (the whole batch, every feature, ``torch.get_num_threads()`` OpenMP threads);
features are read in place through a table of their row pointers that the C++ op builds from the list.
``available`` is False where the package was built without its native kernels; the lowering then chooses their
torch kernels.
"""
from __future__ import annotations

import torch

from hkv.native import NativeLibrary

DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})  # the dtypes runtime/csrc/ops.cpp takes
NATIVE = NativeLibrary("recompile.runtime._C", DTYPES)
available = NATIVE.available
ops = torch.ops.recompile_native


def dot_interaction(items, prefix, upper, self_interaction):
    """The pairs after the prefix: one op call, which reads the items in place (their row pointers and the pair
    ranges are built in C++)."""
    return ops.dot_interaction(items, prefix, upper, self_interaction)


def dot_interaction_backward(grad, items, k, upper, self_interaction):
    """The gradients of the features, one contiguous tensor per item; ``grad`` is [B, k + P]."""
    return ops.dot_interaction_backward(grad, items, k, upper, self_interaction)


def cross_epilogue(x0, x, h, bias, out=None, hb=None):
    """``x0 * (h + bias) + x`` in one pass over [B, D], into ``out`` (may be ``h`` or ``x``: in place); with
    ``hb`` (may be ``h``), ``h + bias`` too. All given tensors contiguous."""
    x0, x, h = x0.contiguous(), x.contiguous(), h.contiguous()
    out = torch.empty_like(x, memory_format=torch.contiguous_format) if out is None else out
    ops.cross_epilogue_fwd(x0, x, h, None if bias is None else bias.contiguous(), out, hb)
    return out


# Width the inference cross stack pads its rows to: MKL's GEMM on [256, 333] x [333, 333] runs 10% slower
# than on the padded [256, 336] x [336, 336] (64-byte rows of fp32), which does more work. Narrower rows are not
# padded: there the copies in and out cost more than the GEMMs gain (TorchRec's DLRM_DCN, D = 40, rank 4: the
# padded stack took twice eager's time at batch 1 and 128).
ROW_ALIGN, PAD_MIN_WIDTH = 16, 256
# Zero-padded copies of the weights an inference stack multiplies by, made once per weight and version.
_padded = torch.utils.weak.WeakIdKeyDictionary()


def padded(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``t`` in the top-left corner of zeros of ``shape``, cached while ``t`` is alive and unchanged (its
    version counter and storage: an in-place update or ``.data =`` makes a new copy)."""
    stamp = (t._version, t.data_ptr(), shape)
    hit = _padded.get(t)
    if hit is None or hit[0] != stamp:
        out = t.new_zeros(shape)
        out[tuple(slice(0, n) for n in t.shape)] = t.detach()
        hit = _padded[t] = (stamp, out)
    return hit[1]


def _cross_stack_padded(x0, x, weights, biases, downs, width):
    """Inference stack on rows padded with zeros to ``width``: padded columns of x0, x, W (rows and columns)
    and b are zero, so those of every h and x_l stay zero; the result is the first D columns (contiguous, as
    the op's fake promises)."""
    batch, dim = x0.shape
    x0p = x0.new_zeros(batch, width)
    x0p[:, :dim] = x0
    if x is x0:
        x = x0p
    else:
        x, xp = x0p.new_zeros(batch, width), x
        x[:, :dim] = xp
    for layer, weight in enumerate(weights):
        rows = weight.shape[1] if downs else width
        z = x if not downs else torch.mm(x, padded(downs[layer], (downs[layer].shape[0], width)).t())
        h = torch.mm(z, padded(weight, (width, rows)).t())
        bias = padded(biases[layer], (width,)) if biases else None
        x = cross_epilogue(x0p, x, h, bias, out=h)
    return x[:, :dim].contiguous()


def cross_stack(x0, x, weights, biases, downs, save):
    """(x_L, saved) of ``recompile.runtime.interaction.cross_stack``. Layers whose weights stay in cache
    (``cross_stack_fused``: rank x D up to 16K floats) run fused, all layers per tile of rows in one C pass
    (csrc/interaction.h: x and x0 read once, x_L written once; the same call, below autograd, serves compiled
    graphs without this Python). Larger ones per layer: the matmul (MKL, no bias: addmm would copy the bias into
    the output first), then bias, ``x0 *`` and ``+ x`` in one C pass. An inference call writes x_{l+1} over h_l (no
    allocation), rows of ``PAD_MIN_WIDTH`` or more padded to ``ROW_ALIGN`` elements (cached padded weights); a
    saving one keeps h_l + b_l in h_l's buffer and x_{l+1} apart."""
    if ops.cross_stack_fused(downs[0].shape[0] if downs else x0.shape[1], x0.shape[1]):
        out, saved = ops.cross_stack_fwd(x0, x, weights, biases, downs, save)
        return out, list(saved)
    width = -(-x0.shape[1] // ROW_ALIGN) * ROW_ALIGN
    if not save and width != x0.shape[1] >= PAD_MIN_WIDTH:
        return _cross_stack_padded(x0, x, weights, biases, downs, width), []
    x0, x = x0.contiguous(), x.contiguous()
    hbs, inputs = [], []
    for layer, weight in enumerate(weights):
        z = x if not downs else torch.mm(x, downs[layer].t())
        h = torch.mm(z, weight.t())
        bias = biases[layer] if biases else None
        if save:
            hbs.append(h)
            inputs.append(x)
        x = cross_epilogue(x0, x, h, bias, out=None if save else h, hb=h if save else None)
    return x, hbs + inputs[1:]


def cross_mixture(x0, x, gate, downs, mids, ups, biases, activation):
    """The output of an inference DCN-Mix layer (``recompile.runtime.interaction.cross_mixture``) in one C pass, or
    None where its weights do not stay in cache (``cross_stack_fused`` of its E (rank + 1) rows)."""
    if not ops.cross_stack_fused(len(downs) * (downs[0].shape[0] + 1), x.shape[1]):
        return None
    return ops.cross_mixture_fwd(x0, x, gate, downs, mids, ups, biases, activation)


def cross_epilogue_backward(grad, x0, h, bias):
    """(grad_h, grad_x0, grad_bias) of ``x0 * (h + bias) + x`` in one pass."""
    grad, x0, h = grad.contiguous(), x0.contiguous(), h.contiguous()
    grad_h, grad_x0 = torch.empty_like(grad), torch.empty_like(grad)
    grad_bias = None if bias is None else torch.empty(grad.shape[1], dtype=torch.float32)
    ops.cross_epilogue_bwd(grad, x0, h, None if bias is None else bias.contiguous(), grad_h, grad_x0, grad_bias)
    return grad_h, grad_x0, None if bias is None else grad_bias.to(bias.dtype)


def fm_second_order(v, reduce):
    return ops.fm_second_order_fwd(v, reduce)


if available():  # the C++ ops' fakes, so that torch.export and torch.compile can trace a direct call

    @torch.library.register_fake("recompile_native::fm_second_order_fwd")
    def _(v, reduce):
        return v.new_empty(v.shape[0], 1 if reduce else v.shape[2])

    @torch.library.register_fake("recompile_native::fm_second_order_bwd")
    def _(grad, v, reduce):
        return v.new_empty(v.shape)


def fm_second_order_backward(grad, v, reduce):
    return ops.fm_second_order_bwd(grad, v, reduce)


def _vector_cross_params(weights, biases):
    """The layers' [D] weights and biases as float [L, Dp], rows zero-padded to a multiple of 16 (the kernel's
    whole vectors)."""
    pad = -len(weights[0]) % 16

    def rows(params):
        return torch.nn.functional.pad(torch.stack(params).float(), (0, pad)).contiguous()

    return rows(weights), rows(biases) if biases else None


def vector_cross(x0, x, weights, biases):
    """x_L of the DCN-v1 vector cross (runtime.interaction.vector_cross), one pass over the batch."""
    x0, x = x0.contiguous(), x.contiguous()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    ops.vector_cross_fwd(x0, x, *_vector_cross_params(weights, biases), out)
    return out


def vector_cross_backward(grad, x0, x, weights, biases):
    """(grad_x0, grad_x, grad_weights, grad_biases): float [D] rows of grad_W / grad_B (none without biases)."""
    grad, x0, x = grad.contiguous(), x0.contiguous(), x.contiguous()
    W, B = _vector_cross_params(weights, biases)
    grad_x0, grad_x = torch.empty_like(x), torch.empty_like(x)
    grad_W = torch.empty_like(W)
    grad_B = None if B is None else torch.empty_like(B)
    ops.vector_cross_bwd(grad, x0, x, W, B, grad_x0, grad_x, grad_W, grad_B)
    dim = x.shape[1]
    return grad_x0, grad_x, list(grad_W[:, :dim].unbind(0)), [] if grad_B is None else list(grad_B[:, :dim].unbind(0))
