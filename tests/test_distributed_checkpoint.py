"""Sharded checkpoints in one process: crash safety and corrupt files (multi-rank resharding: test_distributed)."""
from __future__ import annotations

import os

import pytest
import torch

from hkv import CheckpointError
from models.dlrm import DLRM, DLRMConfig, synthetic_batch
from recompile.distributed import checkpoint, distribute

CFG = DLRMConfig(num_dense=4, table_rows=[30, 20], dim=4, bottom=[8, 4], top=[8, 1])


def _trained(seed: int):
    torch.manual_seed(seed)
    model = distribute(DLRM(CFG))
    opt = torch.optim.Adagrad(model.parameters(), lr=0.1)
    model(*synthetic_batch(CFG, 8)).sum().backward()
    opt.step()
    return model, opt


def _params(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_save_load_restores_parameters_and_optimizer_state(tmp_path):
    model, opt = _trained(0)
    checkpoint.save(model, str(tmp_path / "ckpt"), opt)
    fresh, fresh_opt = _trained(1)
    checkpoint.load(fresh, str(tmp_path / "ckpt"), fresh_opt)
    for name, value in _params(model).items():
        torch.testing.assert_close(dict(fresh.named_parameters())[name].detach(), value, rtol=0, atol=0)
    table = fresh.embeddings[0].weight
    torch.testing.assert_close(fresh_opt.state[table]["sum"], opt.state[model.embeddings[0].weight]["sum"])


def test_a_crash_during_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt")
    model, opt = _trained(0)
    checkpoint.save(model, path, opt)
    saved = _params(model)
    later, later_opt = _trained(1)

    def die(target, write):
        raise KeyboardInterrupt("killed mid-save")

    monkeypatch.setattr(checkpoint, "_atomic", die)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(later, path, later_opt)
    monkeypatch.undo()
    checkpoint.load(later, path, later_opt)
    for name, value in saved.items():
        torch.testing.assert_close(dict(later.named_parameters())[name].detach(), value, rtol=0, atol=0)


def test_corrupt_or_incomplete_checkpoints_are_rejected_by_name(tmp_path):
    path = str(tmp_path / "ckpt")
    model, opt = _trained(0)
    checkpoint.save(model, path, opt)
    shard = os.path.join(path, "embeddings.1.rank0.hkv")
    data = bytearray(open(shard, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(shard, "wb").write(bytes(data))
    with pytest.raises(CheckpointError, match="embeddings.1.rank0.hkv.*checksum"):
        checkpoint.load(model, path, opt)
    os.remove(os.path.join(path, "manifest.json"))
    with pytest.raises(FileNotFoundError, match="not a complete recompile checkpoint"):
        checkpoint.load(model, path, opt)
