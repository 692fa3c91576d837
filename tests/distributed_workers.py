"""Rank functions for tests/test_distributed*.py, run in separate processes (gloo on 127.0.0.1)."""
from __future__ import annotations

import os

import torch

from models.bench_distributed import ctr_features
from models.dlrm import DLRM, DLRMConfig, synthetic_batch
from recompile.launch import spawn


def run_ranks(fn, world_size: int, *args, timeout_s: float = 120.0, collective_timeout_s: float = 30.0):
    return spawn(fn, world_size, *args, timeout_s=timeout_s, collective_timeout_s=collective_timeout_s,
                 preload=["tests.distributed_workers"])


CFG = DLRMConfig(num_dense=5, table_rows=[40, 64, 100, 24], dim=8, bottom=[16, 8], top=[16, 1], max_ids_per_bag=3)
LR = 0.1


def global_batches(steps: int, batch: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        dense, indices, offsets = synthetic_batch(CFG, batch, gen)
        out.append((dense, indices, offsets, torch.randint(0, 2, (batch,), generator=gen).float()))
    return out


def local_part(batch, rank: int, world_size: int):
    """This rank's contiguous slice of a global batch (bags and their ids)."""
    dense, indices, offsets, labels = batch
    n = dense.shape[0] // world_size
    lo, hi = rank * n, (rank + 1) * n
    local_ids, local_offsets = [], []
    for ids, offs in zip(indices, offsets):
        ends = torch.cat([offs[1:], torch.tensor([ids.numel()])])
        start, end = int(offs[lo]), int(ends[hi - 1])
        local_ids.append(ids[start:end])
        local_offsets.append(offs[lo:hi] - start)
    return dense[lo:hi], local_ids, local_offsets, labels[lo:hi]


def train(model, batches, rank: int = 0, world_size: int = 1, opt=None):
    opt = opt or torch.optim.SGD(model.parameters(), lr=LR)
    for batch in batches:
        dense, ids, offs, labels = local_part(batch, rank, world_size)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(model(dense, ids, offs), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


def full_state(model) -> dict:
    """Dense parameters, and each sharded table's rows with their global row offset."""
    from recompile.distributed import sharded_tables

    inner = getattr(model, "module", model)
    inner = getattr(inner, "_orig_mod", inner)
    inner = getattr(inner, "module", inner)
    tables = {f"{name}.weight": t for name, t in sharded_tables(inner)}
    dense = {n: p.detach().clone() for n, p in inner.named_parameters() if n not in tables}
    return {"dense": dense, "tables": {n: (t.row_start, t.weight.detach().clone()) for n, t in tables.items()}}


def assemble(states: list[dict]) -> dict:
    """The single-process parameters from every rank's ``full_state``: dense from rank 0, table rows placed."""
    out = dict(states[0]["dense"])
    for name in states[0]["tables"]:
        pieces = sorted(state["tables"][name] for state in states if state["tables"][name][1].numel())
        out[name] = torch.cat([rows for _, rows in pieces])
        assert [start for start, _ in pieces] == [sum(r.shape[0] for _, r in pieces[:i]) for i in range(len(pieces))]
    return out


def reference_state(steps: int, batch: int, momentum: float = 0.0) -> dict:
    """Parameters after ``steps`` global batches in one process."""
    torch.manual_seed(0)
    model = DLRM(CFG)
    train(model, global_batches(steps, batch), opt=torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum))
    return {n: p.detach() for n, p in model.named_parameters()}


def compiled_training(rank, world_size, kinds, steps, batch):
    """Dense layers and owners' pooling compiled by rec_ascend; the tables the embedding pass groups in a round."""
    import recompile
    from recompile.distributed import compile_lookups
    from recompile.distributed.sharded_embedding import pool_local

    from torch._dynamo.testing import CompileCounterWithBackend

    dmp = _sharded_dlrm(world_size, kinds, batch, features=True)
    lookups, dense = CompileCounterWithBackend("rec_ascend"), CompileCounterWithBackend("rec_ascend")
    compile_lookups(dmp.module, backend=lookups)
    compiled, rounds = dmp.module.embeddings[0].lookup_fn, []
    for table in dmp.module.embeddings:
        table.lookup_fn = lambda *args: rounds.append(args) or compiled(*args)
    train(torch.compile(dmp, backend=dense), global_batches(steps, batch), rank, world_size)
    regions = recompile.explain(pool_local, *rounds[-1]).to_dict()["regions"]
    grouped = [len(r["replaced"]) - 1 for r in regions if r["op"] == "recompile::grouped_embedding_bag"]  # less the cat
    return {"state": full_state(dmp), "lookup_graphs": lookups.frame_count, "dense_graphs": dense.frame_count,
            "local_tables": len(rounds[-1][0]), "grouped": grouped}


def _sharded_dlrm(world_size: int, kinds, batch: int, features: bool = False):
    """DLRM planned with sharding ``kinds``, or with the shardings ``kinds`` maps table names to."""
    from recompile.distributed import distribute, plan, table_specs

    torch.manual_seed(0)
    model = DLRM(CFG)
    fixed = kinds if isinstance(kinds, dict) else None
    sharding = plan(table_specs(model, pooling=2.0), world_size, batch // world_size,
                    kinds=("table_wise", "row_wise") if fixed else kinds, fixed=fixed)
    return distribute(model, sharding, features=ctr_features(model) if features else None)


def prefetched_training(rank, world_size, steps, batch):
    """Row-wise DLRM whose tables are looked up in one round per step; returns the state and all-to-all counts."""
    from recompile.distributed import STATS

    dmp = _sharded_dlrm(world_size, ("row_wise",), batch, features=True)
    STATS.reset()
    train(dmp, global_batches(steps, batch), rank, world_size)
    return {"state": full_state(dmp), "calls": dict(STATS.calls)}


def checkpoint_continue(rank, world_size, kinds, path, save_after, steps, load, batch=16):
    """Train ``save_after`` steps and save to ``path`` (or load it), then train to ``steps``; SGD with momentum."""
    from recompile.distributed import checkpoint

    dmp = _sharded_dlrm(world_size, kinds, batch)
    opt = torch.optim.SGD(dmp.parameters(), lr=LR, momentum=0.9)
    batches = global_batches(steps, batch)
    if load:
        checkpoint.load(dmp, path, opt)
    else:
        train(dmp, batches[:save_after], rank, world_size, opt)
        checkpoint.save(dmp, path, opt)
    train(dmp, batches[save_after:], rank, world_size, opt)
    return full_state(dmp)


KEY_POOL = torch.randint(1, 1 << 40, (300,), generator=torch.Generator().manual_seed(7))


class DynamicModel(torch.nn.Module):
    """Two hkv tables of raw 64-bit keys (constant initialiser, so every layout builds the same rows)."""

    def __init__(self):
        super().__init__()
        import hkv
        from hkv.embedding import DynamicEmbInitializerArgs, DynamicEmbInitializerMode, DynamicEmbTableOptions

        init = DynamicEmbInitializerArgs(mode=DynamicEmbInitializerMode.CONSTANT, value=0.05)
        options = DynamicEmbTableOptions(dim=8, max_capacity=1 << 12, init_capacity=256, initializer_args=init)
        self.tables = torch.nn.ModuleList(
            hkv.DynamicEmbeddingBag(options, optimizer=hkv.optim.Adagrad(lr=0.5), name=f"keys{i}") for i in range(2))
        self.head = torch.nn.Linear(4 + 16, 1)

    def forward(self, dense, ids, offsets):
        embs = [t(i, o) for t, i, o in zip(self.tables, ids, offsets)]
        return self.head(torch.cat([dense, *embs], dim=1)).squeeze(1)


def dynamic_batches(steps: int, batch: int):
    gen = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        ids, offs = [], []
        for _ in range(2):
            lengths = torch.randint(1, 4, (batch,), generator=gen)
            ids.append(KEY_POOL[torch.randint(0, KEY_POOL.numel(), (int(lengths.sum()),), generator=gen)])
            offs.append(torch.cumsum(lengths, 0) - lengths)
        labels = torch.randint(0, 2, (batch,), generator=gen).float()
        out.append((torch.randn(batch, 4, generator=gen), ids, offs, labels))
    return out


def table_contents(model) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, value rows with optimizer state) of each dynamic table on this rank, sorted by key."""
    from recompile.distributed.checkpoint import _unwrap

    out = []
    for t in _unwrap(model).tables:
        keys, values, _ = t.table.export_batch(t.table.capacity())
        order = torch.argsort(keys)
        out.append((keys[order], values[order]))
    return out


def dynamic_training(rank, world_size, steps, batch, path=None):
    """Train the dynamic-table model; save a checkpoint to ``path`` when given."""
    from recompile.distributed import checkpoint, distribute

    torch.manual_seed(0)
    model = distribute(DynamicModel())
    train(model, dynamic_batches(steps, batch), rank, world_size)
    if path:
        checkpoint.save(model, path)
    inner = getattr(model, "module", model)
    return {"tables": table_contents(model), "dense": {n: p.detach() for n, p in inner.head.named_parameters()}}


def dynamic_restored(path):
    """The dynamic-table model of one process restored from ``path``."""
    from recompile.distributed import checkpoint, distribute

    model = distribute(DynamicModel())
    checkpoint.load(model, path)
    return table_contents(model)


class MixedTables(torch.nn.Module):
    """An unpooled table fed 2-D ids, mean bags with an empty bag, weighted sum bags with a last offset."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(23, 4)
        self.mean = torch.nn.EmbeddingBag(17, 3, mode="mean")
        self.weighted = torch.nn.EmbeddingBag(29, 5, mode="sum", include_last_offset=True)
        self.head = torch.nn.Linear(1, 1)  # DDP wants a dense parameter

    def lookups(self, gen: torch.Generator) -> dict:
        n = int(torch.randint(10, 16, (), generator=gen))
        hot = torch.randperm(29, generator=gen)[:4]  # few distinct ids: sent once each, with positions
        return {"emb": self.emb(torch.randint(0, 23, (5, 3), generator=gen)),
                "mean": self.mean(torch.randint(0, 17, (n,), generator=gen), torch.tensor([0, 2, 2, 5])),
                "weighted": self.weighted(hot[torch.randint(0, 4, (n,), generator=gen)], torch.tensor([0, 3, n]),
                                          per_sample_weights=torch.rand(n, generator=gen))}


def mixed_tables(rank, world_size, shardings):
    """Every pooling mode sharded by ``shardings``: outputs equal the unsharded tables', gradients their sum over
    the ranks (divided by the world size)."""
    import copy

    import torch.distributed as dist
    from recompile.distributed import ShardingPlan, distribute

    torch.manual_seed(0)
    ref = MixedTables()
    dmp = distribute(copy.deepcopy(ref), ShardingPlan(shardings, world_size=world_size))
    gen_ref, gen = (torch.Generator().manual_seed(rank) for _ in range(2))
    got, want = dmp.module.lookups(gen), ref.lookups(gen_ref)
    errors = {}
    for name in want:
        weights = torch.randn(want[name].shape, generator=gen)
        (got[name] * weights).sum().backward()
        (want[name] * weights).sum().backward()
        errors[f"{name} output"] = _max_abs(got[name] - want[name])
    for name in want:
        full = getattr(ref, name).weight.grad
        dist.all_reduce(full)
        shard = getattr(dmp.module, name)
        grad = shard.weight.grad if shard.weight.grad is not None else torch.zeros_like(shard.weight)
        errors[f"{name} grad"] = _max_abs(grad * world_size - full[shard.row_start:shard.row_end])
    return errors


def _max_abs(t: torch.Tensor) -> float:
    return float(t.detach().abs().max()) if t.numel() else 0.0


def out_of_step(rank, world_size):
    """Rank 1 skips table 0's lookup: both ranks must fail, naming the rounds, not pool each other's tables."""
    dmp = _sharded_dlrm(world_size, ("row_wise",), 16)
    dense, ids, offs, _ = local_part(global_batches(1, 16)[0], rank, world_size)
    tables = dmp.module.embeddings
    return [tables[t](ids[t], offs[t]) for t in ((0, 1) if rank == 0 else (1,))]


def dead_rank(rank, world_size):
    """Rank 1 exits inside the second step's lookup of table 1; the others must fail, not hang."""
    dmp = _sharded_dlrm(world_size, ("row_wise",), 16)
    step = [0]
    if rank == 1:
        dmp.module.embeddings[1].register_forward_pre_hook(lambda *_: os._exit(3) if step[0] else None)
    for batch in global_batches(2, 16):
        train(dmp, [batch], rank, world_size)
        step[0] += 1
    return "finished"


def torchrec_model():
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

    tables = [EmbeddingBagConfig(name=f"t{i}", embedding_dim=8, num_embeddings=50, feature_names=[f"f{i}"])
              for i in range(2)]

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
            self.head = torch.nn.Linear(16, 1)

        def forward(self, kjt):
            return self.head(self.ebc(kjt).values()).squeeze(1)

    return Model()


def torchrec_plan(model, world_size: int, kind: str):
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.types import ParameterConstraints

    constraints = {f"t{i}": ParameterConstraints(sharding_types=[kind]) for i in range(2)}
    return EmbeddingShardingPlanner(topology=Topology(world_size=world_size, compute_device="cpu"),
                                    constraints=constraints)


def torchrec_dmp_compiled(rank, world_size, kind):
    """TorchRec's own DistributedModelParallel, compiled with rec_ascend: outputs against the eager DMP."""
    import torch.distributed as dist
    from torchrec import KeyedJaggedTensor
    from torchrec.distributed.model_parallel import DistributedModelParallel

    torch.manual_seed(0)
    model = torchrec_model()
    plan = torchrec_plan(model, world_size, kind).collective_plan(model, None, dist.GroupMember.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan)
    gen = torch.Generator().manual_seed(rank)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=["f0", "f1"], values=torch.randint(0, 50, (12,), generator=gen),
                                              lengths=torch.tensor([1, 2, 1, 2, 3, 3]))
    eager = dmp(kjt).detach()
    compiled = torch.compile(dmp, backend="rec_ascend")(kjt)
    compiled.sum().backward()
    return {"eager": eager, "compiled": compiled.detach(), "plan": str(dmp.plan)}
