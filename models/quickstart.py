"""Compile a small DLRM with rec_ascend and print eager vs rec_ascend forward timings (synthetic data)."""
from __future__ import annotations

import time

import torch

from models.dlrm import DLRM, DLRMConfig, synthetic_batch


def _time(fn, args, iters: int = 50) -> float:
    for _ in range(5):
        fn(*args)
    start = time.perf_counter()
    for _ in range(iters):
        fn(*args)
    return (time.perf_counter() - start) / iters * 1e3


def main() -> None:
    torch.manual_seed(0)
    cfg = DLRMConfig()
    model = DLRM(cfg).eval()
    args = synthetic_batch(cfg, 256)
    compiled = torch.compile(model, backend="rec_ascend")
    with torch.no_grad():
        torch.testing.assert_close(compiled(*args), model(*args), rtol=1e-5, atol=1e-6)
        eager_ms, rec_ms = _time(model, args), _time(compiled, args)
    print("DLRM forward, batch 256, synthetic data")
    print(f"  eager      {eager_ms:8.3f} ms")
    print(f"  rec_ascend {rec_ms:8.3f} ms  ({eager_ms / rec_ms:.2f}x eager)")


if __name__ == "__main__":
    main()
