"""recompile.export / recompile.package (recompile/export.py): the exported program carries the rec ops, runs
other batch sizes and jagged totals than it was exported with (dynamic dims), equals eager; the AOTInductor
package loads in a fresh process that imports only the operator library and equals eager there too; a model
with an hkv table exports its lookups as ops on a table bound by name, and its package runs in a fresh process
that restores the table and binds it."""
import os
import subprocess
import sys

import pytest
import torch
from torch.export import Dim

import hkv
import recompile
from models.layers_jagged import HSTULayer, jagged_batch

DIM, MAX_LEN = 32, 16
DYNAMIC = ({0: Dim("total")}, {0: Dim("batch")})


def hstu_layer():
    return HSTULayer(dim=DIM, heads=2, head_dim=16, max_seq_len=MAX_LEN).eval()


def batch(size, seed):
    return jagged_batch(size, MAX_LEN, DIM, torch.Generator().manual_seed(seed))


def recompile_ops(program) -> set:
    return {str(n.target) for n in program.graph.nodes if n.op == "call_function" and "recompile" in str(n.target)}


def test_export_replaces_regions_and_keeps_dims_dynamic():
    model = hstu_layer()
    program = recompile.export(model, batch(4, 0), dynamic_shapes=DYNAMIC)
    assert {"recompile.hstu_attention.default", "recompile.complete_cumsum.default"} <= recompile_ops(program)
    assert any(r["op"] == "recompile::hstu_attention" for r in program.graph_module.meta["recompile_regions"])
    run = program.module()
    with torch.no_grad():
        for size, seed in ((4, 1), (7, 2), (1, 3)):
            inputs = batch(size, seed)
            torch.testing.assert_close(run(*inputs), model(*inputs), rtol=1e-5, atol=1e-6)


def test_export_rejects_a_graph_break():
    class Breaks(torch.nn.Module):
        def forward(self, x):
            torch._dynamo.graph_break()
            return x + 1

    with pytest.raises(Exception, match="graph_break|graph break|Graph break"):
        recompile.export(Breaks(), (torch.randn(3),))


LOAD_AND_RUN = """
import sys, torch
from recompile import runtime  # the operator library only: no passes, no backend


def only_the_ops():
    more = [m for m in sys.modules if m.startswith("recompile.") and not m.startswith("recompile.runtime")]
    assert not more, more


only_the_ops()
from models.layers_jagged import jagged_batch
run = torch._inductor.aoti_load_package(sys.argv[1])
for size, seed in ((5, 11), (2, 12)):
    values, lengths = jagged_batch(size, {max_len}, {dim}, torch.Generator().manual_seed(seed))
    torch.save(run(values, lengths), sys.argv[2] + str(size))
only_the_ops()
"""


@pytest.mark.slow
def test_package_runs_in_a_fresh_process_without_the_passes(tmp_path):
    model = hstu_layer()
    path = recompile.package(model, batch(4, 0), str(tmp_path / "hstu.pt2"), dynamic_shapes=DYNAMIC)
    script = LOAD_AND_RUN.format(max_len=MAX_LEN, dim=DIM)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root)
    proc = subprocess.run([sys.executable, "-c", script, path, str(tmp_path / "out")], capture_output=True, text=True,
                          timeout=240, cwd=root, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with torch.no_grad():
        for size, seed in ((5, 11), (2, 12)):
            expected = model(*batch(size, seed))
            torch.testing.assert_close(torch.load(tmp_path / f"out{size}"), expected, rtol=1e-5, atol=1e-6)


class HkvTower(torch.nn.Module):
    """An hkv embedding bag (ids are raw hashes) and a dense layer."""

    def __init__(self):
        super().__init__()
        self.items = hkv.DynamicEmbeddingBag(hkv.DynamicEmbTableOptions(dim=8, max_capacity=1024), "sum")
        self.head = torch.nn.Linear(8, 2)

    def forward(self, ids, offsets):
        return self.head(self.items(ids, offsets))


def bags(size, seed):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 5, (size,), generator=g)
    ids = torch.randint(0, 2**40, (int(lengths.sum()),), generator=g) % 3000  # some ids were never inserted
    return ids, torch.nn.functional.pad(lengths.cumsum(0), (1, 0))[:-1]


def trained_hkv_tower():
    torch.manual_seed(0)
    model = HkvTower()
    for seed in range(3):
        model(*bags(64, seed)).sum().backward()  # inserts ids, updates their rows
    return model.eval()


HKV_DYNAMIC = ({0: Dim("ids")}, {0: Dim("bags")})


def test_export_looks_hkv_tables_up_by_name():
    model = trained_hkv_tower()
    program = recompile.export(model, bags(6, 10), dynamic_shapes=HKV_DYNAMIC)
    targets = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
    assert {"recompile.hkv_served_unique.default", "recompile.hkv_served_lookup.default"} <= targets
    assert not any(t.startswith("hkv.") for t in targets)  # no process-local table id left
    assert program.graph_module.meta["hkv_tables"] == ["items"]
    with torch.no_grad():
        for size, seed in ((6, 11), (13, 12), (1, 13)):
            torch.testing.assert_close(program.module()(*bags(size, seed)), model(*bags(size, seed)))
    with pytest.raises(KeyError, match="hkv table 'elsewhere'.*serve_table"):
        torch.ops.recompile.hkv_served_lookup(*torch.zeros(3, 1, dtype=torch.int64), "elsewhere")


def test_export_refuses_a_training_lookup():
    model = trained_hkv_tower().train()
    with pytest.raises(Exception, match="training lookup"):
        recompile.export(model, bags(6, 10))


LOAD_HKV = """
import sys, torch
from recompile import runtime
from recompile.lowering.hkv import serve_table
assert "recompile.passes" not in sys.modules and "recompile.export" not in sys.modules
from tests.test_export import HkvTower, bags
model = HkvTower().eval()
model.load_state_dict(torch.load(sys.argv[3]))  # the table restored from its checkpoint, in this process
serve_table("items", model.items)
run = torch._inductor.aoti_load_package(sys.argv[1])
for size, seed in ((9, 21), (2, 22)):
    torch.save(run(*bags(size, seed)), sys.argv[2] + str(size))
assert "recompile.passes" not in sys.modules
"""


@pytest.mark.slow
def test_hkv_package_runs_in_a_fresh_process_with_its_table_bound_by_name(tmp_path):
    model = trained_hkv_tower()
    path = recompile.package(model, bags(6, 10), str(tmp_path / "hkv.pt2"), dynamic_shapes=HKV_DYNAMIC)
    torch.save(model.state_dict(), tmp_path / "state.pt")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", LOAD_HKV, path, str(tmp_path / "out"), str(tmp_path / "state.pt")],
                          capture_output=True, text=True, timeout=240, cwd=root, env=dict(os.environ, PYTHONPATH=root))
    assert proc.returncode == 0, proc.stderr[-3000:]
    with torch.no_grad():
        for size, seed in ((9, 21), (2, 22)):
            torch.testing.assert_close(torch.load(tmp_path / f"out{size}"), model(*bags(size, seed)))
