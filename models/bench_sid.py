"""SID-GR beam search: one shared context KV against per-beam copies, side by side in one run.

    python -m models.bench_sid [--quick] [--backend rec_ascend] [--json docs/benchmarks/sid_gr.json]

A user context of 1,000 tokens (999 history items + BOS), 256 beams, items as 3-level codes. Two searches
with the same model and the same result (checked):
- shared: ``models.sid_gr.beam_search``: the context runs once; each decode step attends to the one context
  KV and the beams' own KV through ``recompile::beam_decode_attention`` (the step compiled with ``--backend``);
- per-beam: each decode step re-runs the whole sequence ``[context, codes so far]`` for every beam (no KV
  reuse; beams in chunks to bound the attention buffers), as a decoder with no shared context would.
Reports the bytes of KV each holds (shared: the context once + the per-beam buffers; per-beam copies: the
context KV once per beam + the same buffers) and the wall-clock time of each search (best of the rounds).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess

import torch

from .sid_gr import SIDGR, BeamResult, CodeTrie, SIDGRConfig, beam_search
from .timing import race_ms
from .train import compile_for

CONTEXT, BEAMS, LEVELS, CODEBOOK, ITEMS = 1000, 256, 3, 32, 8192


def synthetic_codes(items: int, levels: int, codebook: int, seed: int) -> torch.Tensor:
    """``items`` distinct code tuples drawn uniformly from ``codebook ** levels``."""
    flat = torch.randperm(codebook ** levels, generator=torch.Generator().manual_seed(seed))[:items]
    return torch.stack([(flat // codebook ** (levels - 1 - l)) % codebook for l in range(levels)], 1)


@torch.no_grad()
def rerun_search(model: SIDGR, history: torch.Tensor, lengths: torch.Tensor, beams: int, k: int,
                 chunk: int = 32) -> BeamResult:
    """The same search without KV reuse: every step runs the full sequence of every beam (one user)."""
    scores, nodes, code, _ = model.first_beams(model.prefill(history, lengths)[2], beams)
    paths = code.view(beams, 1)
    for level in range(1, model.levels):
        parts = []
        for rows in torch.arange(beams).split(chunk):
            n = lengths.expand(len(rows))
            hidden, _ = model._run_blocks(model._sequence(history.expand(len(rows), -1), n, paths[rows]))
            last = hidden.gather(1, (n + level).view(-1, 1, 1).expand(-1, 1, hidden.shape[2])).squeeze(1)
            parts.append(torch.log_softmax(model._logits(last, torch.tensor(level)), -1))
        scores, nodes, code, parent = model.select(scores, torch.cat(parts).unsqueeze(0), nodes, torch.tensor(level))
        paths = torch.cat([paths[parent[0]], code.view(beams, 1)], 1)
    return BeamResult.top(scores, nodes, k)


def kv_bytes(model: SIDGR, history: torch.Tensor, lengths: torch.Tensor, beams: int) -> dict[str, int]:
    context, _, _ = model.prefill(history, lengths)
    shared = sum(t.nbytes for kv in context for t in kv)
    own = beams * (model.levels - 1) * shared // context[0][0].shape[1]  # one token's KV per beam and step
    return {"shared_context_kv": shared + own, "per_beam_copies": beams * shared + own}


def metadata() -> dict:
    commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                            cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    return {"machine": platform.node(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "commit": commit}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m models.bench_sid", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="1 timed round instead of 3, a 1-layer dim-32 decoder")
    p.add_argument("--backend", default="rec_ascend", choices=("eager", "inductor", "rec_ascend"),
                   help="how the shared search's decode step is compiled")
    p.add_argument("--threads", type=int)
    p.add_argument("--json", default="docs/benchmarks/sid_gr.json")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    codes = synthetic_codes(ITEMS, LEVELS, CODEBOOK, seed=0)
    cfg = SIDGRConfig(num_items=ITEMS, dim=32 if args.quick else 64, num_layers=1 if args.quick else 2, num_heads=2,
                      max_history=CONTEXT - 1, dropout=0.0)
    model = SIDGR(cfg, CodeTrie(codes, [CODEBOOK] * LEVELS)).eval()
    history = torch.randint(1, ITEMS + 1, (1, CONTEXT - 1))
    lengths = torch.tensor([CONTEXT - 1])
    step = compile_for(model.decode_step, args.backend)
    shared = beam_search(model, history, lengths, BEAMS, 10, step=step)
    rerun = rerun_search(model, history, lengths, BEAMS, 10)
    if not torch.equal(shared.items, rerun.items):
        raise RuntimeError(f"bench_sid: the searches disagree: {shared.items} vs {rerun.items}")
    torch.testing.assert_close(shared.scores, rerun.scores, rtol=1e-4, atol=1e-4)
    ms = race_ms({"shared": lambda: beam_search(model, history, lengths, BEAMS, 10, step=step),
                  "per_beam": lambda: rerun_search(model, history, lengths, BEAMS, 10)}, 1 if args.quick else 3,
                 warmup=0)  # the checked searches above were the warm-up
    memory = kv_bytes(model, history, lengths, BEAMS)
    result = {
        "setting": {"context_tokens": CONTEXT, "beams": BEAMS, "levels": LEVELS, "codebook": CODEBOOK,
                    "items": ITEMS, "dim": cfg.dim, "layers": cfg.num_layers, "heads": cfg.num_heads,
                    "backend": args.backend, "rounds": 1 if args.quick else 3},
        "kv_bytes": memory, "memory_ratio": memory["shared_context_kv"] / memory["per_beam_copies"],
        "search_ms": ms, "speedup": ms["per_beam"] / ms["shared"], "same_top10": True, **metadata(),
    }
    print(f"KV bytes: shared {memory['shared_context_kv']:,} vs per-beam copies {memory['per_beam_copies']:,} "
          f"(ratio 1/{1 / result['memory_ratio']:.0f}, target <= 1/100)")
    print(f"search: shared {ms['shared']:.1f} ms vs re-running per beam {ms['per_beam']:.1f} ms "
          f"(x{result['speedup']:.1f}, target >= 10x); same top-10 items")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
