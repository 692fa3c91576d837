"""options.bounds_check reaches the jagged ops the jagged pass emits (issue 22's leftover): a compiled padded HSTU
region fed malformed offsets raises a ValueError naming the op and argument ("fatal"), or repairs them the way
every jagged op does, with a warning ("warning") or silently ("ignore"), giving eager's numbers on the repaired
offsets."""
import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import recompile

fbgemm_gpu = pytest.importorskip("fbgemm_gpu")
N, C, H = 6, 8, 2
GOOD, MALFORMED, REPAIRED = [0, 2, 5, 7], [0, 5, 3, 7], [0, 5, 5, 7]  # offsets[2] < offsets[1]


class PaddedHSTU(nn.Module):
    """Jagged values padded with FBGEMM, HSTU attention with a causal key mask, gathered back with FBGEMM."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.qkv = nn.Linear(C, 3 * C)

    def forward(self, values, offsets):
        b = offsets.shape[0] - 1
        q, k, v = (torch.ops.fbgemm.jagged_to_padded_dense(t, [offsets], [N]).view(b, N, H, C // H)
                   for t in F.silu(self.qkv(values)).split(C, dim=-1))
        lengths = (offsets[1:] - offsets[:-1]).view(-1, 1, 1)
        ids = torch.arange(N)
        mask = ((ids.view(1, N, 1) >= ids.view(1, 1, N)) & (ids.view(1, 1, N) < lengths)).float()
        attn = F.silu(torch.einsum("bnhd,bmhd->bhnm", q, k) / math.sqrt(C // H)) / N * mask.unsqueeze(1)
        out = torch.einsum("bhnm,bmhd->bnhd", attn, v).reshape(b, N, C)
        return torch.ops.fbgemm.dense_to_jagged(out, [offsets])[0]


def compiled_for(mode, autotune=False):
    torch._dynamo.reset()
    model = PaddedHSTU()
    compiled = torch.compile(model, backend="rec_ascend", options={"bounds_check": mode, "autotune": autotune})
    values = torch.randn(7, C)
    torch.testing.assert_close(compiled(values, torch.tensor(GOOD)), model(values, torch.tensor(GOOD)))
    return model, compiled, values


def test_the_pass_emits_the_mode():
    report = recompile.explain(PaddedHSTU(), torch.randn(7, C), torch.tensor(GOOD),
                               options={"bounds_check": "ignore"}).to_dict()
    assert ("attention", "recompile::hstu_attention") in {(r["kind"], r["op"]) for r in report["regions"]}
    final = report["stages"][-1]["code"]
    assert final.count("'ignore'") >= 2 and "'fatal'" not in final  # jagged_within and hstu_attention


def test_fatal_names_the_op_and_argument():
    _, compiled, values = compiled_for("fatal")
    with pytest.raises(ValueError, match=r"recompile\.jagged_within: offsets must start at 0, be non-decreasing"):
        compiled(values, torch.tensor(MALFORMED))


@pytest.mark.parametrize("mode, autotune", [("warning", False), ("ignore", False), ("warning", True)])
def test_warning_and_ignore_repair_the_offsets(mode, autotune):
    """With the race on too (it rewrites each op's kernel, its last argument: bounds_check is a keyword)."""
    model, compiled, values = compiled_for(mode, autotune)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = compiled(values, torch.tensor(MALFORMED))
    ours = [str(w.message) for w in caught if "recompile." in str(w.message)]
    if mode == "warning":
        assert ours and all("offsets must start at 0, be non-decreasing" in m for m in ours), ours
    else:
        assert ours == []
    torch.testing.assert_close(got, model(values, torch.tensor(REPAIRED)), rtol=1e-5, atol=1e-5)
