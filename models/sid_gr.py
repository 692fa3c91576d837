"""SID-GR: generative retrieval over semantic IDs. A causal decoder reads a user's history and generates the
next item's code tuple (``models.semantic_ids``) level by level; a beam search pruned to the item trie returns
the top items. ``python -m models.sid_gr`` trains and evaluates it on MovieLens-100k beside HSTU.

- ``CodeTrie``: the items' code tuples as dense per-level tables ``table [levels, nodes, codes]``: the node
  (prefix) reached by appending a code, ``-1`` where no item continues so, and at the last level the item id.
- ``SIDGR``: item and position embeddings, SASRec's causal blocks (``models.sequential.SASRecBlock``) over
  ``[history, BOS, c_1, ..., c_{L-1}]`` (right-padded: the BOS sits right after each history), one output head
  per level; calling it gives the teacher-forced cross entropy over the ``L`` codes (the training loss).
- ``beam_search``: the context ``[history, BOS]`` runs once (``prefill``: its per-layer keys and values, one
  copy per user: ContextKV); each step feeds every beam's last code, whose keys and values go to a fixed-size
  per-beam buffer (BeamKV) and whose query attends to both through ``recompile::beam_decode_attention``. The
  candidates are pruned to the trie (no beam can leave the item set) and the best ``beams`` kept (BeamPath:
  parents gathered, their buffers with them). Every step has the same shapes, the level a tensor, so
  ``torch.compile`` captures the step once.
"""
from __future__ import annotations

import argparse
import itertools
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from recompile import runtime  # noqa: F401  (defines torch.ops.recompile.beam_decode_attention)
from . import data as D
from .compare import K, METRICS, MODEL_ARGS, paired, seed_table, train_runs
from .main import EPOCHS, popularity_ranks
from .metrics import ranking_metrics, user_gains
from .semantic_ids import SemanticIds, rq_kmeans
from .sequential import SASRecBlock, SASRecConfig, init_embeddings
from .train import Progress, Run, compile_for, make_optimizer, optimizer_step, train_sequential, write_json
from .train import parser as train_parser


def _at(table: torch.Tensor, level: torch.Tensor) -> torch.Tensor:
    """``table[level]`` for a level tensor, as an index_select: no data-dependent shape for torch.compile."""
    return table.index_select(0, level.reshape(-1)).view(*level.shape, *table.shape[1:])


class CodeTrie(nn.Module):
    """Valid code prefixes of items ``1..n`` (``codes[i - 1]`` is item ``i``'s tuple)."""

    def __init__(self, codes: torch.Tensor, codebook_sizes: list[int]):
        super().__init__()
        n, levels = codes.shape
        if len(torch.unique(codes, dim=0)) != n:
            raise ValueError("CodeTrie: two items share a code tuple; resolve collisions first (rq_kmeans does)")
        nodes = [torch.zeros(n, dtype=torch.int64)]  # each item's prefix node at each level (the root: 0)
        for level in range(1, levels):
            nodes.append(torch.unique(codes[:, :level], dim=0, return_inverse=True)[1])
        width = max(int(x.max()) + 1 for x in nodes)
        children = torch.full((levels, width, max(codebook_sizes)), -1, dtype=torch.int64)
        for level in range(levels):
            child = nodes[level + 1] if level + 1 < levels else torch.arange(1, n + 1)
            children[level, nodes[level], codes[:, level]] = child
        self.register_buffer("table", children, persistent=False)
        self.register_buffer("codes", codes.clone(), persistent=False)

    @property
    def levels(self) -> int:
        return self.table.shape[0]


@dataclass
class SIDGRConfig(SASRecConfig):
    max_history: int = 50


class SIDGR(nn.Module):
    def __init__(self, cfg: SIDGRConfig, trie: CodeTrie):
        levels, width = trie.levels, trie.table.shape[2]
        super().__init__()
        self.cfg, self.trie, self.levels, self.width = cfg, trie, levels, width
        self.item_emb = nn.Embedding(cfg.num_items + 1, cfg.dim, padding_idx=0)
        self.code_emb = nn.Embedding(levels * width, cfg.dim)  # (level, code) -> level * width + code
        self.bos = nn.Parameter(torch.zeros(cfg.dim))
        seq_len = cfg.max_history + levels
        self.pos_emb = nn.Embedding(seq_len, cfg.dim)
        init_embeddings(self.item_emb, self.code_emb, self.pos_emb)
        nn.init.trunc_normal_(self.bos, std=0.02)
        self.dropout = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(SASRecBlock(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.LayerNorm(cfg.dim)
        self.head_w = nn.Parameter(torch.randn(levels, cfg.dim, width) * cfg.dim ** -0.5)
        self.head_b = nn.Parameter(torch.zeros(levels, width))
        self.register_buffer("causal", torch.ones(seq_len, seq_len).tril().bool(), persistent=False)

    # ---- the full sequence: training, prefill and exhaustive scoring ----------------------------------

    def _sequence(self, history: torch.Tensor, lengths: torch.Tensor, codes: torch.Tensor | None) -> torch.Tensor:
        """``[B, T, D]`` inputs: history (right-padded ``[B, max_history]``), then at ``lengths`` the BOS and the
        first ``codes.shape[1]`` code tokens (``codes [B, c]``, None for none)."""
        batch = history.shape[0]
        group = self.bos.expand(batch, 1, -1)
        if codes is not None and codes.shape[1]:
            level = torch.arange(codes.shape[1], device=codes.device)
            group = torch.cat([group, self.code_emb(level * self.width + codes)], 1)
        x = self.item_emb(history) * math.sqrt(self.cfg.dim)
        x = F.pad(x, (0, 0, 0, group.shape[1]))
        at = (lengths.view(-1, 1) + torch.arange(group.shape[1], device=x.device)).unsqueeze(-1)
        x = x.scatter(1, at.expand(-1, -1, x.shape[2]), group)
        return self.dropout(x + self.pos_emb.weight[: x.shape[1]])

    def _run_blocks(self, x: torch.Tensor) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Hidden states and each layer's keys and values ``[B, T, H, Dh]``."""
        causal, keep, kv = self.causal[: x.shape[1], : x.shape[1]], x.new_ones(()), []
        for block in self.blocks:
            kv.append((self._heads(block.attn.k(x)), self._heads(block.attn.v(x))))
            x = block(x, causal, keep)
        return self.norm(x), kv

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        return t.unflatten(-1, (self.cfg.num_heads, self.cfg.dim // self.cfg.num_heads))

    def _logits(self, hidden: torch.Tensor, level: torch.Tensor) -> torch.Tensor:
        """``hidden [..., D]`` at the positions predicting ``level`` (broadcast) -> ``[..., width]``."""
        return torch.einsum("...d,...dk->...k", hidden, _at(self.head_w, level)) + _at(self.head_b, level)

    def code_logits(self, history: torch.Tensor, lengths: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """Teacher-forced ``[B, L, width]`` logits of the target ``codes [B, L]``."""
        hidden, _ = self._run_blocks(self._sequence(history, lengths, codes[:, :-1]))
        at = lengths.view(-1, 1) + torch.arange(self.levels, device=hidden.device)
        hidden = hidden.gather(1, at.unsqueeze(-1).expand(-1, -1, hidden.shape[2]))
        return self._logits(hidden, torch.arange(self.levels, device=hidden.device))

    def forward(self, history: torch.Tensor, lengths: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        """Mean cross entropy of the ``L`` codes of each target item."""
        return F.cross_entropy(self.code_logits(history, lengths, codes).flatten(0, 1), codes.flatten())

    @torch.no_grad()
    def exhaustive_scores(self, history: torch.Tensor, lengths: torch.Tensor, chunk: int = 256) -> torch.Tensor:
        """``[B, n]``: every item's log-probability ``sum_l log p(c_l | history, c_<l)``, item by item."""
        codes, out = self.trie.codes, []
        for user in range(history.shape[0]):
            scores = []
            for part in codes.split(chunk):
                h, n = history[user].expand(len(part), -1), lengths[user].expand(len(part))
                logp = torch.log_softmax(self.code_logits(h, n, part), -1)
                scores.append(logp.gather(2, part.unsqueeze(-1)).squeeze(-1).sum(1))
            out.append(torch.cat(scores))
        return torch.stack(out)

    # ---- beam search ------------------------------------------------------------------------------------

    def prefill(self, history: torch.Tensor, lengths: torch.Tensor):
        """Context ``[history, BOS]`` once: per-layer ``(k, v) [B, T, H, Dh]`` (ContextKV), the context lengths
        and the first level's log-probabilities ``[B, width]``."""
        hidden, kv = self._run_blocks(self._sequence(history, lengths, None))
        last = hidden.gather(1, lengths.view(-1, 1, 1).expand(-1, 1, hidden.shape[2])).squeeze(1)
        return kv, lengths + 1, torch.log_softmax(self._logits(last, torch.zeros((), dtype=torch.long)), -1)

    def select(self, scores: torch.Tensor, logp: torch.Tensor, nodes: torch.Tensor, level: torch.Tensor):
        """Keep the best ``W`` valid extensions of ``W`` beams: ``scores, nodes [B, W]``, ``logp [B, W, width]``
        at ``level`` -> (new scores, the children reached, the codes chosen, each new beam's parent)."""
        beams = scores.shape[1]
        children = _at(self.trie.table, level)[nodes.clamp(min=0)]  # [B, W, width]
        cand = torch.where(children >= 0, scores.unsqueeze(-1) + logp, float("-inf")).flatten(1)
        top, index = cand.topk(beams, dim=1)
        parent, code = index // self.width, index % self.width
        return top, children.flatten(1).gather(1, index), code, parent

    def first_beams(self, logp: torch.Tensor, beams: int):
        """``select`` of the first level from the root (one live beam, the rest ``-inf``), ``logp [B, width]``."""
        batch, width = logp.shape
        start = torch.full((batch, beams), float("-inf"), device=logp.device)
        start[:, 0] = 0.0
        first = torch.full((batch, beams, width), float("-inf"), device=logp.device)
        first[:, 0] = logp
        zero = torch.zeros((), dtype=torch.long, device=logp.device)
        return self.select(start, first, torch.zeros_like(start, dtype=torch.long), zero)

    def decode_step(self, context, context_lengths, beam_kv, scores, nodes, codes, level, impl: str = "cpu"):
        """Feed each beam's last ``codes [B, W]`` (of ``level``), attend to ContextKV + its BeamKV, and select
        the next level's beams. ``beam_kv``: per layer ``(k, v) [B, W, S, H, Dh]``, slot ``level`` written."""
        batch, beams = codes.shape
        position = (context_lengths + level).view(batch, 1)
        x = self.code_emb(level * self.width + codes) + self.pos_emb(position)
        slot = (torch.arange(beam_kv[0][0].shape[2], device=codes.device) == level).view(1, 1, -1, 1, 1)
        lengths = (level + 1).expand(batch)
        new_kv = []
        for block, (ctx_k, ctx_v), (own_k, own_v) in zip(self.blocks, context, beam_kv):
            attn = block.attn
            query = block.attn_norm(x)
            own_k = torch.where(slot, self._heads(attn.k(x)).unsqueeze(2), own_k)
            own_v = torch.where(slot, self._heads(attn.v(x)).unsqueeze(2), own_v)
            new_kv.append((own_k, own_v))
            out = torch.ops.recompile.beam_decode_attention(
                self._heads(attn.q(query)), ctx_k, ctx_v, context_lengths, own_k, own_v, lengths,
                (self.cfg.dim // self.cfg.num_heads) ** -0.5, impl)
            x = block.ffn_norm(query + attn.out(out.flatten(-2)))
            x = x + block.ffn(x)
        logp = torch.log_softmax(self._logits(self.norm(x), level + 1), -1)
        scores, nodes, codes, parent = self.select(scores, logp, nodes, level + 1)
        index = parent.view(batch, beams, 1, 1, 1)
        beam_kv = [tuple(t.gather(1, index.expand_as(t)) for t in kv) for kv in new_kv]
        return beam_kv, scores, nodes, codes


@dataclass
class BeamResult:
    items: torch.Tensor  # [B, k] item ids, best first (-1 where fewer than k items were reachable)
    scores: torch.Tensor  # [B, k] their log-probabilities

    @classmethod
    def top(cls, scores: torch.Tensor, items: torch.Tensor, k: int) -> "BeamResult":
        """The first ``k`` of the final beams (best first); beams that reached no item (``-inf``) give -1."""
        return cls(torch.where(scores > float("-inf"), items, -1)[:, :k], scores[:, :k])


def decode_impl(device: torch.device) -> str:
    """The beam_decode_attention kernel the lowering registry picks for ``device``."""
    from recompile.lowering import choose, detect_target

    return choose("recompile::beam_decode_attention", detect_target(device.type)).impl


@torch.no_grad()
def beam_search(model: SIDGR, history: torch.Tensor, lengths: torch.Tensor, beams: int, k: int,
                step=None, impl: str | None = None) -> BeamResult:
    """Top-``k`` items of each user by a ``beams``-wide search over the trie. ``step``: the decode step to run
    (``model.decode_step`` or a compiled version of it); ``impl``: its attention kernel (the registry's choice)."""
    if not 1 <= k <= beams:
        raise ValueError(f"beam_search: k ({k}) must be in [1, beams ({beams})]")
    step = step or model.decode_step
    impl = impl or decode_impl(history.device)
    context, context_lengths, logp = model.prefill(history, lengths)
    batch = logp.shape[0]
    scores, nodes, codes, _ = model.first_beams(logp, beams)
    suffix = model.levels - 1
    beam_kv = [tuple(t.new_zeros(batch, beams, suffix, *t.shape[2:]) for t in kv) for kv in context]
    for level in range(suffix):
        beam_kv, scores, nodes, codes = step(context, context_lengths, beam_kv, scores, nodes, codes,
                                             torch.tensor(level, device=logp.device), impl)
    return BeamResult.top(scores, nodes, k)


# ---- MovieLens-100k: training and evaluation against HSTU and popularity ----------------------------------


def interaction_features(train: D.UserSequences, dim: int, seed: int) -> torch.Tensor:
    """Item features ``[num_items, dim]``: the items' side of a rank-``dim`` SVD of the binary user x item
    training matrix, unit length (items never trained on stay zero: the collision level tells them apart)."""
    users = np.repeat(np.arange(len(train.items)), [len(s) for s in train.items])
    matrix = torch.zeros(len(train.items), train.num_items)
    matrix[users, np.concatenate(train.items) - 1] = 1.0
    torch.manual_seed(seed)
    _, s, v = torch.svd_lowrank(matrix, q=dim, niter=4)
    return F.normalize(v * s, dim=1)  # directions: rare items' small rows would otherwise all share codes


def train_sid_gr(args, split: D.LeaveOneOut, sid: SemanticIds) -> SIDGR:
    """Teacher-forced training on every training interaction with the ``max_len`` items before it (``args``:
    ``models.train``'s settings; ``--max-steps`` stops early)."""
    cfg = SIDGRConfig(num_items=split.num_items, dim=args.dim, num_layers=args.num_layers, num_heads=args.num_heads,
                      max_history=args.max_len, dropout=args.dropout)
    model = SIDGR(cfg, CodeTrie(sid.codes, sid.codebook_sizes))
    step_fn = compile_for(model, args.backend)
    pairs = D.user_item_pairs(split.train, args.max_len)
    g = torch.Generator().manual_seed(args.seed)
    num_batches = math.ceil(len(pairs.items) / args.batch_size)
    optimizer, scheduler = make_optimizer(args, model.parameters(), num_batches * args.epochs)
    epochs = (rows for _ in range(args.epochs) for rows in D.batches(len(pairs.items), args.batch_size, g))
    bar = Progress(num_batches * args.epochs, "sid_gr", not args.quiet)
    model.train()
    for rows in itertools.islice(epochs, args.max_steps):
        histories = [pairs.history[r] for r in rows]
        (history,) = D.sequence_inputs(histories, histories, "padded", args.max_len)
        batch = (history, torch.tensor([len(h) for h in histories]), model.trie.codes[pairs.items[rows] - 1])
        for t in batch:
            torch._dynamo.maybe_mark_dynamic(t, 0)
        bar.update(optimizer_step(optimizer, lambda: step_fn(*batch), scheduler))
    return model.eval()


@torch.no_grad()
def sid_gr_ranks(model: SIDGR, split: D.LeaveOneOut, which: str, max_len: int, beams: int,
                 backend: str) -> torch.Tensor:
    """0-based rank of each user's held-out item in the beam search's list; ``num_items`` when not in it."""
    history, targets = split.held_out(which)
    step, ranks = compile_for(model.decode_step, backend), []
    for rows in D.batches(len(targets), 128):
        (padded,), _ = D.history_inputs(history, rows, "padded", max_len)
        lengths = (padded > 0).sum(1)
        found = beam_search(model, padded, lengths, beams, beams, step=step).items
        hit = found == torch.from_numpy(targets[rows]).view(-1, 1)
        ranks.append(torch.where(hit.any(1), hit.int().argmax(1), split.num_items))
    return torch.cat(ranks)


FEATURES = ("svd", "hstu")


class FeatureTables:
    """The item vectors the codes quantize, per (source, seed), made once: ``"svd"`` (``interaction_features``)
    or ``"hstu"``: the item table of an HSTU trained on the same split and seed with the zoo's settings."""

    def __init__(self, split: D.LeaveOneOut, svd_dim: int, settings, hstu_epochs: int):
        self.split, self.svd_dim, self.settings, self.made = split, svd_dim, settings, {}
        self.hstu_epochs = hstu_epochs

    def __call__(self, source: str, seed: int) -> torch.Tensor:
        if (source, seed) not in self.made:
            self.made[source, seed] = self._make(source, seed)
        return self.made[source, seed]

    def _make(self, source: str, seed: int) -> torch.Tensor:
        if source == "svd":
            return interaction_features(self.split.train, self.svd_dim, seed)
        args = argparse.Namespace(**{**vars(self.settings), "model": "hstu", "seed": seed, "epochs": self.hstu_epochs})
        task, _ = train_sequential(args, self.split, Run(max_steps=args.max_steps))
        return task.item_embeddings().detach()


def sid_gr_run(args, settings, split: D.LeaveOneOut, features: FeatureTables, seed: int, which: str):
    """Codes from ``args.features`` / ``args.codebook``, SID-GR trained on ``seed``, ranked on ``which``:
    (the run's record, the tokenizer's report)."""
    sid = rq_kmeans(features(args.features, seed), args.levels, args.codebook, seed=seed)
    model = train_sid_gr(argparse.Namespace(**{**vars(settings), "seed": seed}), split, sid)
    ranks = sid_gr_ranks(model, split, which, settings.max_len, args.beams, settings.backend)
    run = {"seed": seed, "features": args.features, "codebook": args.codebook,
           "metrics": ranking_metrics(ranks, (K,)), "ranks": ranks.tolist()}
    return run, sid.report()


def tune(args, settings, split: D.LeaveOneOut, features: FeatureTables) -> tuple[list[dict], dict]:
    """Every (features, codebook) of the grid trained on the first seed and ranked on the validation item (the
    second-to-last: the test item is never seen); the best NDCG@10 (then HR@10) is chosen."""
    seed, trials = args.seeds[0], []
    for source, codebook in itertools.product(args.grid_features, args.grid_codebook):
        trial = argparse.Namespace(**{**vars(args), "features": source, "codebook": codebook})
        run, report = sid_gr_run(trial, settings, split, features, seed, "valid")
        trials.append({"features": source, "codebook": codebook, "metrics": run["metrics"], "codes": report})
        print(f"validation: features {source} codebook {codebook}: {run['metrics']}", flush=True)
    best = max(trials, key=lambda t: (t["metrics"][METRICS[1]], t["metrics"][METRICS[0]]))
    return trials, {"features": best["features"], "codebook": best["codebook"]}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m models.sid_gr", description=EVAL_DOC)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--levels", type=int, default=3)
    p.add_argument("--codebook", type=int, default=32)
    p.add_argument("--features", choices=FEATURES, default="svd",
                   help="what the codes quantize: the interaction SVD, or the item table of a trained HSTU")
    p.add_argument("--feature-dim", type=int, default=32, help="rank of the interaction SVD the codes quantize")
    p.add_argument("--tune", action="store_true",
                   help="choose --features and --codebook on the validation item (first seed), then evaluate")
    p.add_argument("--grid-features", choices=FEATURES, nargs="+", default=list(FEATURES))
    p.add_argument("--grid-codebook", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--beams", type=int, default=20)
    p.add_argument("--hstu-epochs", type=int, default=EPOCHS)
    p.add_argument("--workers", type=int, default=2, help="HSTU training runs at once, one thread each")
    p.add_argument("--json", default="docs/benchmarks/sid_gr_quality.json")
    args, train_argv = p.parse_known_args(argv)
    settings = train_parser().parse_args(["--data", "ml-100k", "--backend", "eager", *train_argv])
    split = D.leave_one_out(D.load_ratings())
    which = settings.eval_split
    features = FeatureTables(split, args.feature_dim, settings, args.hstu_epochs)
    validation, chosen = tune(args, settings, split, features) if args.tune else ([], {})
    args = argparse.Namespace(**{**vars(args), **chosen})
    sid_runs, tokenizers = [], []
    for seed in args.seeds:
        run, report = sid_gr_run(args, settings, split, features, seed, which)
        sid_runs.append(run)
        tokenizers.append(report)
        print(f"SID-GR seed {seed}: {run['metrics']} codes {report}", flush=True)
    hstu_common = ["--data", "ml-100k", "--backend", "eager", "--eval-split", which, "--quiet",
                   "--epochs", str(args.hstu_epochs)]
    hstu_runs = train_runs(argparse.Namespace(models=["hstu"], seeds=args.seeds, workers=args.workers), hstu_common,
                           MODEL_ARGS)["hstu"]
    popularity = popularity_ranks(split, which)
    summary = seed_table({"sid_gr": sid_runs, "hstu": hstu_runs}, ranking_metrics(popularity), args.seeds)
    gains = {name: {m: np.stack([user_gains(torch.tensor(r["ranks"]), m).numpy() for r in runs]) for m in METRICS}
             for name, runs in (("sid_gr", sid_runs), ("hstu", hstu_runs))}
    gains["popularity"] = {m: user_gains(popularity, m)[None].numpy() for m in METRICS}
    comparisons = []
    for better, worse in (("sid_gr", "popularity"), ("sid_gr", "hstu"), ("hstu", "sid_gr")):
        for metric in METRICS:
            per_seed = None if worse == "popularity" else (summary[better][metric]["per_seed"],
                                                           summary[worse][metric]["per_seed"])
            result = paired(gains[better][metric], gains[worse][metric], per_seed)
            comparisons.append({"better": better, "worse": worse, "metric": metric,
                                "holds": result["bootstrap_ci95"][0] > 0, **result})
            lo, hi = result["bootstrap_ci95"]
            print(f"  {better} > {worse} on {metric}: diff {result['mean_diff']:+.4f}, 95% CI [{lo:+.4f}, {hi:+.4f}]"
                  f" -> {'holds' if lo > 0 else 'NOT shown'}")
    out = {"eval_split": which, "seeds": args.seeds, "sid_settings": vars(args), "settings": vars(settings),
           "validation": validation, "chosen_on_validation": chosen,
           "tokenizers": tokenizers, "summary": summary, "comparisons": comparisons,
           "hstu_epochs": args.hstu_epochs}
    if args.json:
        write_json(args.json, out)
    return out


EVAL_DOC = ("SID-GR on MovieLens-100k (leave-one-out, HR@10 / NDCG@10) beside HSTU retrieval and popularity, over "
            "seeds, paired as models.compare pairs its models.")

if __name__ == "__main__":
    main()
