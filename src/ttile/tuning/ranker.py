"""A learned ranking of schemes, trained from the tuning records.

The search measures candidates in the order the IOOpt model and pruning put them; most of
the time goes into measuring schemes that lose. The records hold every such measurement
(problem, scheme, microkernels, threads, CPU, time), so a model trained on them can say
which few candidates are worth measuring - as PolyScientist and the "AI powered compiler
techniques" paper rank variants with a learned model, and TVM's tuners with a cost model
trained on measurements.

* **What is learned.** Within one group of measurements (one CPU, vector family, problem
  and thread count, screened with the same protocol), the speed of each scheme relative
  to the group's best, as ``log(gflops / best gflops)``. Only the order within a group
  matters for ranking, and the relative target makes groups of very different sizes
  comparable.
* **Features** (:func:`features`) come from the problem, the lowered scheme (the block,
  the loops above it, the reduction band, the parallel band), the CPU's caches and the
  microkernel's measured rate in that CPU's table (step 1 of the search). They need the
  scheme parser and numpy only.
* **Model**: gradient-boosted regression trees (:class:`BoostedTrees`), written here
  with numpy (histogram splits on quantile bins). It ships as a small JSON file
  (``generator/ranker/ranker.json``) and predicts with numpy alone: no heavy import on the
  ``conv2d`` path.
* **Evaluation** (:func:`evaluate`): whole problems are held out (every CPU's and
  thread count's records of a layer leave training together), and each held-out group
  is ranked by the model; what the model's first (and first three) picks reach, against
  the best measured and against the order the search measured them in.
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence

import numpy as np

from ..core.kinds import Isa
from ..core.scheme import Block, Loop, Node, Scheme, SchemeError, Seq, lower
from ..core.spec import REDUCTION_DIMS, ConvSpec
from ..core.vectors import vector_isa

RANKER_FORMAT = 1

#: Feature names, in the order of :func:`features`' columns.
FEATURES = (
    "log2_flops", "log2_k", "log2_c", "log2_hw_out", "r", "stride", "lanes", "k_tail",
    "alpha", "beta", "unroll_r", "unroll_s", "axis_w", "registers_used",
    "lambda_seq", "log2_reduction_above", "whole_reduction_inside", "loop_depth",
    "k_outermost_position", "log2_panel_bytes_over_l1", "log2_panel_bytes_over_l2",
    "log2_input_tile_bytes_over_l1", "threads", "log2_parallel_iterations_per_thread",
    "parallel_has_reduction_above", "microkernel_percent", "log2_l2_bytes",
)


@dataclass(frozen=True)
class CpuContext:
    """What the features need to know of the CPU a scheme runs on."""

    l1d_bytes: int
    l2_bytes: int
    #: measured % of peak of each microkernel block (``MicrokernelShape.key``)
    microkernel_percent: dict

    @classmethod
    def from_table(cls, table) -> "CpuContext":
        percent = {m.shape.key: m.percent_of_peak for m in table.measurements
                   if m.status.value == "ok"}
        return cls(table.cpu.l1d_bytes or 32768, table.cpu.l2_bytes or (1 << 20), percent)


def _chain(node: Node) -> tuple[list[Loop], Block, bool]:
    """The loops from the root to the (first) block, and whether a Seq was crossed."""
    loops: list[Loop] = []
    seq = False
    while not isinstance(node, Block):
        if isinstance(node, Loop):
            loops.append(node)
            node = node.body
        else:
            seq = True
            node = node.branches[0]
    return loops, node, seq


def _block_key(block: Block, spec: ConvSpec) -> tuple[str, int]:
    """The microkernel table key of a block and its spatial size (beta)."""
    axis = "w" if block.count("w") > 1 or block.count("h") == 1 else "h"
    beta = block.count(axis)
    r = block.count("r")
    s = block.count("s")
    return f"r{r}s{s}_{axis}_a{block.count('k')}b{beta}", beta


def features(spec: ConvSpec, scheme: Scheme | str, threads: int, isa: Isa,
             cpu: CpuContext) -> Optional[np.ndarray]:
    """The feature row of ``scheme`` on ``spec`` (None if the scheme does not lower for
    this problem and family)."""
    if isinstance(scheme, str):
        scheme = Scheme.parse(scheme)
    vectors = vector_isa(isa)
    try:
        tree = lower(scheme, spec, vectors.isa)
    except SchemeError:
        return None
    loops, block, seq = _chain(tree)
    lanes = vectors.lanes
    key, beta = _block_key(block, spec)
    alpha = block.count("k")
    # the reduction band right above the block, and whether it holds the whole reduction
    above = 1
    reduction = {d: block.count(d) for d in REDUCTION_DIMS}
    for loop in reversed(loops):
        if loop.dim not in REDUCTION_DIMS or loop.parallel:
            break
        above *= loop.count
        reduction[loop.dim] *= loop.count
    whole = float(reduction["c"] == spec.c and reduction["r"] == spec.r
                  and reduction["s"] == spec.s)
    k_positions = [i for i, lp in enumerate(loops) if lp.dim == "k" and lp.count > 1]
    k_outer = k_positions[0] / max(1, len(loops)) if k_positions else 1.0
    panel_bytes = 4 * alpha * lanes * spec.c * spec.r * spec.s
    ih = (block.count("h") - 1) * spec.stride_h + block.count("r")
    iw = (block.count("w") - 1) * spec.stride_w + block.count("s")
    input_tile = 4 * ih * iw * spec.c
    band = [lp for lp in loops if lp.parallel]
    iterations = math.prod(lp.count for lp in band) if band else 1
    first_parallel = next((i for i, lp in enumerate(loops) if lp.parallel), None)
    reduction_above_band = float(first_parallel is not None and any(
        lp.dim in REDUCTION_DIMS for lp in loops[:first_parallel]))
    k_total = spec.k_vectors(lanes) * lanes
    return np.array([
        math.log2(spec.flops), math.log2(spec.k), math.log2(spec.c),
        math.log2(spec.ho * spec.wo), spec.r, spec.stride_h, lanes, (k_total - spec.k) / k_total,
        alpha, beta, block.count("r"), block.count("s"), float("_w_" in key),
        block.registers / vectors.registers,
        float(seq), math.log2(above), whole, len(loops), k_outer,
        math.log2(panel_bytes / cpu.l1d_bytes), math.log2(panel_bytes / cpu.l2_bytes),
        math.log2(input_tile / cpu.l1d_bytes), threads,
        math.log2(max(iterations / threads, 1e-3)), reduction_above_band,
        cpu.microkernel_percent.get(key, -1.0), math.log2(cpu.l2_bytes),
    ], dtype=np.float64)


# ----------------------------------------------------------------------------------
# Gradient-boosted regression trees, numpy only


@dataclass(frozen=True)
class BoostedTrees:
    """Depth-limited regression trees added up: ``predict(X) = base + sum(lr * tree(X))``.

    Each tree is stored as flat arrays (node feature, threshold, children, leaf value),
    so prediction is a few vectorized steps per tree level.
    """

    base: float
    learning_rate: float
    feature: np.ndarray      # [trees, nodes] int; -1 for a leaf
    threshold: np.ndarray    # [trees, nodes] float: go left when x <= threshold
    value: np.ndarray        # [trees, nodes] float (leaves)
    depth: int

    def predict(self, x: np.ndarray) -> np.ndarray:
        x = np.atleast_2d(np.asarray(x, np.float64))
        out = np.full(len(x), self.base)
        rows = np.arange(len(x))
        for feat, thr, val in zip(self.feature, self.threshold, self.value):
            node = np.zeros(len(x), np.int64)
            for _ in range(self.depth):
                f = feat[node]
                inner = f >= 0
                go_right = np.zeros(len(x), bool)
                go_right[inner] = x[rows[inner], f[inner]] > thr[node[inner]]
                node = np.where(inner, 2 * node + 1 + go_right, node)
            out += self.learning_rate * val[node]
        return out

    def to_json(self) -> dict:
        return {"base": self.base, "learning_rate": self.learning_rate, "depth": self.depth,
                "feature": self.feature.tolist(), "threshold": self.threshold.tolist(),
                "value": self.value.tolist()}

    @classmethod
    def from_json(cls, data: dict) -> "BoostedTrees":
        return cls(base=float(data["base"]), learning_rate=float(data["learning_rate"]),
                   depth=int(data["depth"]), feature=np.array(data["feature"], np.int64),
                   threshold=np.array(data["threshold"], np.float64),
                   value=np.array(data["value"], np.float64))


def fit_trees(x: np.ndarray, y: np.ndarray, rounds: int = 200, depth: int = 4,
              learning_rate: float = 0.1, bins: int = 32, min_leaf: int = 20,
              seed: int = 0) -> BoostedTrees:
    """Least-squares gradient boosting: each tree fits the residuals, split points
    searched over per-feature quantile bins (histograms of residual sums)."""
    rng = np.random.default_rng(seed)
    n, m = x.shape
    edges = [np.unique(np.quantile(x[:, j], np.linspace(0, 1, bins + 1)[1:-1]))
             for j in range(m)]
    binned = np.stack([np.searchsorted(edges[j], x[:, j], side="left") for j in range(m)],
                      axis=1)
    nodes = 2 ** (depth + 1) - 1
    base = float(np.mean(y))
    pred = np.full(n, base)
    features = np.full((rounds, nodes), -1, np.int64)
    thresholds = np.zeros((rounds, nodes))
    values = np.zeros((rounds, nodes))
    for t in range(rounds):
        residual = y - pred
        sample = rng.random(n) < 0.8          # stochastic boosting: a fresh 80 % each tree
        node_of = np.where(sample, 0, -1)
        for level in range(depth):
            first = 2 ** level - 1
            for node in range(first, 2 * first + 1):
                members = node_of == node
                count = int(members.sum())
                if count < 2 * min_leaf:
                    continue
                r = residual[members]
                total = r.sum()
                best = (0.0, -1, 0)
                for j in range(m):
                    width = len(edges[j]) + 1
                    if width < 2:
                        continue
                    b = binned[members, j]
                    counts = np.bincount(b, minlength=width)
                    sums = np.bincount(b, weights=r, minlength=width)
                    left_n = np.cumsum(counts)[:-1]
                    left_s = np.cumsum(sums)[:-1]
                    right_n = count - left_n
                    ok = (left_n >= min_leaf) & (right_n >= min_leaf)
                    if not ok.any():
                        continue
                    gain = np.where(ok, left_s ** 2 / np.maximum(left_n, 1)
                                    + (total - left_s) ** 2 / np.maximum(right_n, 1), -np.inf)
                    i = int(np.argmax(gain))
                    if gain[i] - total ** 2 / count > best[0]:
                        best = (float(gain[i] - total ** 2 / count), j, i)
                if best[1] < 0:
                    continue
                _, j, i = best
                features[t, node] = j
                thresholds[t, node] = edges[j][i]
                right = binned[:, j] > i
                node_of = np.where(members, 2 * node + 1 + right, node_of)
        # leaves: the mean residual of the training rows that end there
        leaf_of = np.zeros(n, np.int64)
        for _ in range(depth):
            f = features[t, leaf_of]
            inner = f >= 0
            go = np.zeros(n, bool)
            go[inner] = x[np.arange(n)[inner], f[inner]] > thresholds[t, leaf_of[inner]]
            leaf_of = np.where(inner, 2 * leaf_of + 1 + go, leaf_of)
        sums = np.bincount(leaf_of[sample], weights=residual[sample], minlength=nodes)
        counts = np.bincount(leaf_of[sample], minlength=nodes)
        values[t] = np.where(counts > 0, sums / np.maximum(counts, 1), 0.0)
        pred += learning_rate * values[t, leaf_of]
    return BoostedTrees(base, learning_rate, features, thresholds, values, depth)


# ----------------------------------------------------------------------------------
# Training data from the records


@dataclass(frozen=True)
class Group:
    """The screened measurements of one (CPU, family, problem, thread count)."""

    cpu: str
    isa: Isa
    spec: ConvSpec
    threads: int
    schemes: tuple[str, ...]      # in the order they were measured
    gflops: np.ndarray
    x: np.ndarray                 # feature rows

    @property
    def target(self) -> np.ndarray:
        return np.log(self.gflops / self.gflops.max())


def training_groups(records_dir: Path, tables: dict, min_size: int = 8) -> list[Group]:
    """Every group of screened, correct measurements in ``records_dir`` whose CPU and
    family have a microkernel table in ``tables`` ({(cpu id, isa): table})."""
    from ..core.vectors import parse_family_stem
    from .records import Contender, Protocol, RecordStatus, read_records
    groups = []
    for path in sorted(Path(records_dir).glob("*.jsonl")):
        cpu_id, isa = parse_family_stem(path.stem)
        table = tables.get((cpu_id, isa))
        if table is None:
            continue
        context = CpuContext.from_table(table)
        by_group: dict[tuple, dict[str, float]] = {}
        for r in read_records(path):
            if r.protocol is Protocol.SCREEN and r.status is RecordStatus.OK \
                    and r.contender is Contender.SCHEME:
                by_group.setdefault((r.spec, r.threads), {}).setdefault(r.scheme, r.gflops)
        for (spec, threads), measured in by_group.items():
            rows, schemes, rates = [], [], []
            for scheme, rate in measured.items():
                row = features(spec, scheme, threads, isa, context)
                if row is not None and rate > 0:
                    rows.append(row)
                    schemes.append(scheme)
                    rates.append(rate)
            if len(rows) >= min_size:
                groups.append(Group(cpu_id, isa, spec, threads, tuple(schemes),
                                    np.array(rates), np.stack(rows)))
    return groups


@dataclass(frozen=True)
class Ranker:
    """The trained model and what it was trained on."""

    trees: BoostedTrees
    trained_on: dict

    def scores(self, rows: np.ndarray) -> np.ndarray:
        """Higher is faster (predicted log of the speed relative to the best)."""
        return self.trees.predict(rows)

    def save(self, path: Path) -> Path:
        from ..core.fileio import atomic_write
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps({"format": RANKER_FORMAT, "features": list(FEATURES),
                                       "trained_on": self.trained_on,
                                       "model": self.trees.to_json()}) + "\n")
        return path

    @classmethod
    def load(cls, path: Path) -> "Ranker":
        data = json.loads(Path(path).read_text())
        if data.get("format") != RANKER_FORMAT or tuple(data.get("features", ())) != FEATURES:
            raise ValueError(f"{path}: a ranker of another format or feature set; retrain "
                             f"it with 'ttile-generate train-ranker'")
        return cls(BoostedTrees.from_json(data["model"]), data.get("trained_on", {}))


def train(groups: Sequence[Group], **fit_args) -> Ranker:
    x = np.concatenate([g.x for g in groups])
    y = np.concatenate([g.target for g in groups])
    trees = fit_trees(x, y, **fit_args)
    return Ranker(trees, {"groups": len(groups), "measurements": int(len(y)),
                          "cpus": sorted({g.cpu for g in groups}),
                          "families": sorted({g.isa.value for g in groups})})


# ----------------------------------------------------------------------------------
# Evaluation on held-out problems


@dataclass(frozen=True)
class GroupResult:
    """How the ranking did on one held-out group: the speed (relative to the group's
    best measured) of the model's first pick, the best of its first three, and the
    same for the order the search measured in."""

    group: Group
    model_top1: float
    model_top3: float
    search_top1: float
    search_top3: float
    spearman: float


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    ra = np.argsort(np.argsort(a))
    rb = np.argsort(np.argsort(b))
    if ra.std() == 0 or rb.std() == 0:
        return 0.0
    return float(np.corrcoef(ra, rb)[0, 1])


def judge(group: Group, scores: np.ndarray) -> GroupResult:
    relative = group.gflops / group.gflops.max()
    order = np.argsort(-scores, kind="stable")
    return GroupResult(group, float(relative[order[0]]), float(relative[order[:3]].max()),
                       float(relative[0]), float(relative[:3].max()),
                       _spearman(scores, group.gflops))


def evaluate(groups: Sequence[Group], folds: int = 5, seed: int = 0,
             **fit_args) -> list[GroupResult]:
    """K-fold by problem: each fold's problems (all their CPUs and thread counts) are
    held out of training and ranked by a model trained on the others."""
    problems = sorted({g.spec.key() for g in groups})
    rng = np.random.default_rng(seed)
    rng.shuffle(problems)
    fold_of = {p: i % folds for i, p in enumerate(problems)}
    results = []
    for fold in range(folds):
        train_groups = [g for g in groups if fold_of[g.spec.key()] != fold]
        held = [g for g in groups if fold_of[g.spec.key()] == fold]
        if not held or not train_groups:
            continue
        model = train(train_groups, **fit_args)
        results += [judge(g, model.scores(g.x)) for g in held]
    return results


def summary(results: Sequence[GroupResult]) -> dict:
    def geo(values: Iterable[float]) -> float:
        values = list(values)
        return float(math.exp(statistics.fmean(math.log(v) for v in values)))
    return {"groups": len(results),
            "model_top1": geo(r.model_top1 for r in results),
            "model_top3": geo(r.model_top3 for r in results),
            "search_order_top1": geo(r.search_top1 for r in results),
            "search_order_top3": geo(r.search_top3 for r in results),
            "model_top3_within_5pct": sum(r.model_top3 >= 0.95 for r in results) / len(results),
            "spearman_median": statistics.median(r.spearman for r in results)}


def evaluation_report(results: Sequence[GroupResult], held_out: dict, model: Ranker,
                      folds: int) -> str:
    """The held-out evaluation as Markdown (committed beside the model)."""
    lines = [
        "# The learned ranking of schemes: evaluation on held-out layers",
        "",
        f"Written by `ttile-generate train-ranker`. Boosted trees "
        f"({model.trees.feature.shape[0]} trees of depth {model.trees.depth}) trained on "
        f"{model.trained_on['measurements']} screened measurements in "
        f"{model.trained_on['groups']} groups (CPU x family x problem x threads) from "
        f"{', '.join(model.trained_on['cpus'])}, families "
        f"{', '.join(model.trained_on['families'])}.",
        "",
        f"Evaluation: {folds}-fold by problem (every CPU's and thread count's records of "
        f"a layer are held out together), each held-out group ranked by a model trained "
        f"on the other folds. Speeds are relative to the best the search measured in the "
        f"group (1.0 = the best); *search order* is the order the offline search "
        f"measured them in (the IOOpt model and pruning's order). Geometric means over "
        f"{held_out['groups']} held-out groups:",
        "",
        "| pick | model | search order |",
        "|---|---|---|",
        f"| first | {held_out['model_top1']:.3f} | {held_out['search_order_top1']:.3f} |",
        f"| best of first three | {held_out['model_top3']:.3f} | "
        f"{held_out['search_order_top3']:.3f} |",
        "",
        f"The model's first three reach within 5 % of the best in "
        f"{100 * held_out['model_top3_within_5pct']:.0f} % of the groups; median Spearman "
        f"correlation of its scores with the measured speeds: "
        f"{held_out['spearman_median']:.2f}.",
        "",
        "| CPU | family | layer (problem) | threads | measured | model first | model best of 3 "
        "| search first | search best of 3 | Spearman |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(results, key=lambda r: (r.group.cpu, r.group.isa.value,
                                            r.group.spec.key(), r.group.threads)):
        g = r.group
        lines.append(f"| {g.cpu} | {g.isa.value} | {g.spec.key()} | {g.threads} | "
                     f"{len(g.gflops)} | {r.model_top1:.2f} | {r.model_top3:.2f} | "
                     f"{r.search_top1:.2f} | {r.search_top3:.2f} | {r.spearman:.2f} |")
    return "\n".join(lines) + "\n"


def order(model: Ranker, spec: ConvSpec, candidates: Sequence, threads: int, isa: Isa,
          cpu: CpuContext) -> list:
    """``candidates`` (anything with a ``scheme``) best-scored first; those the features
    cannot describe keep their order, after the others."""
    rows, scored, rest = [], [], []
    for candidate in candidates:
        row = features(spec, candidate.scheme, threads, isa, cpu)
        if row is None:
            rest.append(candidate)
        else:
            rows.append(row)
            scored.append(candidate)
    if not scored:
        return list(rest)
    scores = model.scores(np.stack(rows))
    return [scored[i] for i in np.argsort(-scores, kind="stable")] + rest
