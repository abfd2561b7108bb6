"""Where a network's time goes, layer by layer: each converted convolution's time inside
the network beside the same node's time in onnxruntime's and OpenVINO's profilers.

Run through ``bench_network.py --breakdown``. A whole-network ratio says that ttile loses;
this table says on which layers. Each convolution is timed five ways:

* **in network (hooked)**: the ``TTileConv2d`` module's wall time (forward pre/post
  hooks) while the whole converted network runs, median over the rounds. The hooks make
  each ``TTileSequence`` call its layers one by one as modules, so this column carries
  the per-module torch calls the sequence's fast path saves (ttile's network total below
  is timed without hooks, as the network row of ``bench_network.py``). Its input was
  just written by the layer before and its weights were last touched one inference ago.
  Includes the module's call overhead;
* **fast path**: the same unit's time on the sequence's fast path (each
  ``TTileSequence`` run unit by unit with a clock around each call,
  ``TTileSequence._timed_pass``, on the inputs the sequence met in the network, right
  after a whole inference): no hooks, no per-module torch calls, one team for all the
  units, as a user's call runs them. The ratios to the engines, and ttile's convolution
  total, are taken from this column where a layer has it (a layer outside any sequence
  keeps its hooked time);
* **alone**: the same module called again and again on the input it saw in the network
  (warm caches, weights in L2 where they fit): the number a single-layer benchmark gives;
* **kernel alone**: the module's packed ``ttile.Conv2d`` (a fused block's kernel) called
  the same way on that input
  in NHWC, without the module's Python path (its call, checks and tensor wrapping, about
  10 µs a layer on a Xeon model 167): the profilers' numbers below count no such cost,
  so on small layers this is the column to set beside them;
* **onnxruntime**: the node's ``_kernel_time`` in onnxruntime's profile (default graph
  optimizations, so a Conv there carries its fused bias/activation/Add, and its NCHWc
  reorders are separate nodes, summed under "other");
* **OpenVINO**: the node's ``real_time`` from its performance counters (``PERF_COUNT``).

A fused inverted residual block (``TTileInvertedResidual``) is one row, beside the sum of
the engines' three nodes. Nodes are matched to ttile's layers, not taken in order (the engines run a block's
branches in another order than torch does): onnxruntime's by their output and weight
sizes from its profile (its fused nodes are named after their outputs), OpenVINO's by the
module path in their names (``/4/downsample/downsample.0/Conv`` is ``4.downsample.0``,
the conv a ``TTileConv2d``'s ``source`` names first). A layer an engine merged away or a
node left unmatched is counted in its totals only, and the notes say how many.
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np


@dataclass(frozen=True)
class LayerTime:
    """One convolution: what it is and its median time (µs) per contender."""
    index: int
    name: str
    shape: str
    in_network: float
    alone: float
    kernel: float                                 # the packed Conv2d alone, NHWC
    engines: dict = field(default_factory=dict)   # engine -> µs (absent: not matched)
    fast_path: Optional[float] = None             # in its sequence's fast path

    @property
    def in_context(self) -> float:
        """The time the layer takes where a user's call runs it (µs): on its sequence's
        fast path, or as a module where no sequence runs it."""
        return self.fast_path if self.fast_path is not None else self.in_network


@dataclass(frozen=True)
class Breakdown:
    network: str
    threads: int
    layers: tuple[LayerTime, ...]
    totals: dict        # contender -> ms: network wall time, conv sum, other
    notes: tuple[str, ...]


def _units(converted):
    """What the breakdown times: each fused inverted residual block as one unit (its
    three layers inside it are not timed apart), every other converted convolution."""
    import ttile.torch as tt
    blocks = [(name, m) for name, m in converted.named_modules()
              if isinstance(m, tt.TTileInvertedResidual)]
    inner = {id(layer) for _, b in blocks for layer in b.layers}
    units = blocks + [(name, m) for name, m in tt.served_layers(converted)
                      if id(m) not in inner]
    position = {name: i for i, (name, _) in enumerate(converted.named_modules())}
    return sorted(units, key=lambda unit: position[unit[0]])


def _block_layers(block, x_shape) -> list:
    """(layer, input shape) of a block's layers for an input of x_shape (NCHW)."""
    n, c, h, w = x_shape
    e = block.depthwise.weight.shape[0]
    stride = block.depthwise.stride[0]
    expand = [] if block.expand is None else [(block.expand, (n, c, h, w))]
    return expand + [(block.depthwise, (n, e, h, w)),
                     (block.project, (n, e, (h - 1) // stride + 1, (w - 1) // stride + 1))]


class _Shaped:
    def __init__(self, shape):
        self.shape = shape


def _ttile_layer_times(converted, x, reps: int):
    """Per-module wall times (s) inside the network and each module's captured input."""
    import torch

    layers = _units(converted)
    started: dict = {}
    times: dict = {name: [] for name, _ in layers}
    inputs: dict = {}
    order: list = []
    handles = []
    timing = [False]   # only the timed forward of each round is recorded
    for name, module in layers:
        def pre(mod, args, name=name):
            if name not in inputs:
                inputs[name] = tuple(a.clone() if isinstance(a, torch.Tensor) else a
                                     for a in args)
                order.append(name)
            started[name] = time.perf_counter()

        def post(mod, args, out, name=name):
            if timing[0]:
                times[name].append(time.perf_counter() - started[name])
        handles.append(module.register_forward_pre_hook(pre))
        handles.append(module.register_forward_hook(post))
    walls = []
    with torch.no_grad():
        for _ in range(reps):
            converted(x)   # warm, as bench_network's rounds run it
            timing[0] = True
            t0 = time.perf_counter()
            converted(x)
            walls.append(time.perf_counter() - t0)
            timing[0] = False
    for h in handles:
        h.remove()
    modules = dict(layers)
    return [(name, modules[name], times[name], inputs[name]) for name in order], walls


def _fast_path_times(converted, x, threads: int, reps: int) -> tuple[dict, list]:
    """id(unit) -> seconds per round of every unit of the model's sequences on their fast
    path (``TTileSequence._timed_pass``), each round right after a whole inference, on the
    inputs each sequence met in it (captured by a hook on the sequence itself, which
    leaves its fast path on); and the whole inferences' wall times (s), hooks off."""
    import torch

    import ttile.torch as tt
    sequences = [m for m in converted.modules() if isinstance(m, tt.TTileSequence)]
    inputs: dict = {}
    handles = [s.register_forward_pre_hook(
        lambda mod, args: inputs.setdefault(id(mod), args)) for s in sequences]
    try:
        with torch.no_grad():
            converted(x)
    finally:
        for h in handles:
            h.remove()
    times: dict = {}
    walls = []
    with torch.no_grad():
        for _ in range(reps):
            t0 = time.perf_counter()
            converted(x)
            walls.append(time.perf_counter() - t0)
            for seq in sequences:
                xs = inputs.get(id(seq))
                passed = None if xs is None else seq._timed_pass(list(xs), threads)
                if passed is None:   # not on the fast path: the hooked times stand
                    continue
                for (unit, _, _), seconds in zip(seq._plan, passed[1]):
                    times.setdefault(id(unit), []).append(seconds)
    return times, walls


def _repeated(call, reps: int) -> float:
    """Median seconds of ``call()`` over back-to-back calls after three untimed ones."""
    import torch
    with torch.no_grad():
        for _ in range(3):
            call()
        samples = []
        for _ in range(max(reps, 5)):
            t0 = time.perf_counter()
            call()
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _alone(module, args, reps: int) -> float:
    return _repeated(lambda: module(*args), reps)


def _kernel_alone(module, args, threads: int, reps: int) -> float:
    """``_alone`` for the module's packed Conv2d on the NHWC view of its input (a block's
    fused kernel, or its three Conv2d in turn when it runs as layers)."""
    import torch

    import ttile.torch as tt
    if isinstance(module, tt.TTileInvertedResidual):
        x_nhwc = args[0].contiguous(memory_format=torch.channels_last)
        plan = module.plans.get((tuple(x_nhwc.numpy().transpose(0, 2, 3, 1).shape),
                                 threads))
        if plan is not None and plan.verdict.value == "fused":
            block, x_np = module._block(), x_nhwc.numpy().transpose(0, 2, 3, 1)
            return _repeated(lambda: block(x_np, threads), reps)
        with torch.no_grad():
            total, y = 0.0, args[0]
            for layer in module.layers:
                layer_args = (y, args[0]) if layer.residual else (y,)
                total += _kernel_alone(layer, layer_args, threads, reps)
                y = layer(*layer_args)
        return total

    def nhwc(tensor):
        return tensor.contiguous(memory_format=torch.channels_last).numpy() \
            .transpose(0, 2, 3, 1)
    x, residual = args[0], (args[1] if len(args) > 1 else None)
    layer = module._packed.layer("NHWC")
    x_np, r_np = nhwc(x), (None if residual is None else nhwc(residual))
    return _repeated(lambda: layer(x_np, threads, residual=r_np), reps)


def _is_conv(op: str) -> bool:
    return "Conv" in op and "Transpose" not in op


def _onnxruntime_nodes(model: bytes, x: np.ndarray, threads: int, reps: int):
    """[(node, op, µs, key)] in execution order (per run, median over runs; key: see
    the module text) and the median wall time (ms) of a profiled run."""
    from ttile.peers import onnxruntime_session
    session = onnxruntime_session(model, threads,
                                  profile_prefix=os.path.join(tempfile.mkdtemp(), "ort"))
    feed = {session.get_inputs()[0].name: x}
    for _ in range(3):
        session.run(None, feed)
    walls = []
    for _ in range(reps):
        t0 = time.perf_counter()
        session.run(None, feed)
        walls.append(time.perf_counter() - t0)
    path = session.end_profiling()
    with open(path) as f:
        events = json.load(f)
    # a run's node events precede its model_run event in the file
    runs = _runs_by_closing_event(events)
    timed = runs[-reps:]
    nodes = [(name, op, statistics.median(run[i][2] for run in timed), key)
             for i, (name, op, _, key) in enumerate(timed[0])]
    return nodes, statistics.median(walls) * 1e3


def _elements(shapes, i: int) -> int:
    """The element count of the i-th of a profile event's typed shapes (0: absent)."""
    if len(shapes) <= i:
        return 0
    return int(np.prod(next(iter(shapes[i].values()))))


def _runs_by_closing_event(events) -> list[list]:
    runs, current = [], []
    for event in events:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            args = event.get("args", {})
            key = ("size", _elements(args.get("output_type_shape", []), 0),
                   _elements(args.get("input_type_shape", []), 1))
            current.append((event["name"][:-len("_kernel_time")],
                            args.get("op_name", "?"), event["dur"], key))
        elif event.get("cat") == "Session" and event.get("name") == "model_run":
            runs.append(current)
            current = []
    return [run for run in runs if run]


def _openvino_nodes(model: bytes, x: np.ndarray, threads: int, reps: int):
    """As :func:`_onnxruntime_nodes`, from OpenVINO's performance counters."""
    from ttile.peers import openvino_request
    request = openvino_request(model, threads, perf_counters=True)
    for _ in range(3):
        request.infer({0: x})
    samples: dict = {}
    order: list = []
    walls = []
    for _ in range(reps):
        t0 = time.perf_counter()
        request.infer({0: x})
        walls.append(time.perf_counter() - t0)
        for info in request.get_profiling_info():
            if info.status != info.Status.EXECUTED:
                continue
            key = (info.node_name, info.node_type)
            if key not in samples:
                samples[key] = []
                order.append(key)
            samples[key].append(info.real_time.total_seconds() * 1e6)
    nodes = [(name, op, statistics.median(samples[(name, op)]), ("name", _module_path(name)))
             for name, op in order]
    return nodes, statistics.median(walls) * 1e3


def _module_path(node_name: str) -> str:
    """The torch module path in an exported node's name: ``/4/downsample/downsample.0/
    Conv/WithoutBiases`` -> ``4.downsample.0`` (a scope repeats its parent's name as a
    prefix when it is a container's child)."""
    parts: list[str] = []
    for component in node_name.strip("/").split("/"):
        if component[:1].isupper():   # the op (Conv), then what the engine added
            break
        if parts and component.startswith(parts[-1] + "."):
            parts[-1] = component
        else:
            parts.append(component)
    return ".".join(parts)


def _shape(module, args) -> str:
    import ttile.torch as tt
    if isinstance(module, tt.TTileInvertedResidual):
        n, c, h, w = args[0].shape
        e, k = module.depthwise.weight.shape[0], module.project.weight.shape[0]
        expand = "" if module.expand is None else f"1x1 {c}->{e}, "
        return (f"block {expand}dw 3x3/{module.depthwise.stride[0]}, 1x1 {e}->{k} "
                f"{h}x{w}" + (f" N={n}" if n > 1 else ""))
    x = args[0]
    k, cg, r, s = module.weight.shape
    c = cg * module.groups
    n, h, w = x.shape[0], x.shape[2], x.shape[3]
    kind = "dw " if module.groups == c and c == k and c > 1 else (
        f"g{module.groups} " if module.groups > 1 else "")
    return (f"{kind}{r}x{s}/{module.stride[0]} {c}->{k} {h}x{w}"
            + (f" N={n}" if n > 1 else ""))


def _unit_keys(module, args) -> list:
    """One key set per convolution of a unit (a block has three)."""
    import ttile.torch as tt
    if isinstance(module, tt.TTileInvertedResidual):
        return [_layer_keys(layer, (_Shaped(shape),))
                for layer, shape in _block_layers(module, tuple(args[0].shape))]
    return [_layer_keys(module, args)]


def _layer_keys(module, args) -> set:
    """The keys an engine's node may carry for this layer (see the module text)."""
    x = args[0]
    k, cg, r, s = module.weight.shape
    n, h, w = x.shape[0], x.shape[2], x.shape[3]
    ho = (h + 2 * module.padding[0] - module.dilation[0] * (r - 1) - 1) // module.stride[0] + 1
    wo = (w + 2 * module.padding[1] - module.dilation[1] * (s - 1) - 1) // module.stride[1] + 1
    path = module.source.split("+")[0]
    return {("size", n * k * ho * wo, k * cg * r * s), ("name", path)}


def breakdown(name: str, model, converted, x_cl, x_nchw, onnx_model: Optional[bytes],
              threads: int, reps: int) -> Breakdown:
    """The per-layer table of one network at one thread count (see the module text)."""
    layers, _ = _ttile_layer_times(converted, x_cl, reps)
    fast, fast_walls = _fast_path_times(converted, x_cl, threads, reps)
    notes = []
    engines: dict = {}
    # the network as a user's call runs it: no hooks (they send sequences down their
    # slow path)
    totals = {"ttile": (statistics.median(fast_walls) * 1e3,)}
    if onnx_model is not None:
        for label, fn in (("onnxruntime", _onnxruntime_nodes), ("OpenVINO", _openvino_nodes)):
            try:
                nodes, wall = fn(onnx_model, x_nchw.numpy(), threads, reps)
            except ImportError:
                notes.append(f"{label} not installed")
                continue
            convs = [node for node in nodes if _is_conv(node[1])]
            conv_us = sum(node[2] for node in convs)
            other = sum(node[2] for node in nodes) - conv_us
            totals[label] = (wall, conv_us / 1e3, other / 1e3)
            engines[label] = convs
    rows = []
    matched: dict = {label: set() for label in engines}
    for i, (lname, module, samples, args) in enumerate(layers):
        times = {}
        for label, convs in engines.items():
            found = []
            for keys in _unit_keys(module, args):
                for j, (_, _, us, key) in enumerate(convs):
                    if j not in matched[label] and key in keys:
                        matched[label].add(j)
                        found.append(us)
                        break
            if len(found) == len(_unit_keys(module, args)):
                times[label] = sum(found)
        rows.append(LayerTime(
            index=i, name=lname, shape=_shape(module, args),
            in_network=statistics.median(samples) * 1e6,
            fast_path=(statistics.median(fast[id(module)]) * 1e6 if id(module) in fast
                       else None),
            alone=_alone(module, args, reps) * 1e6,
            kernel=_kernel_alone(module, args, threads, reps) * 1e6, engines=times))
    for label, convs in engines.items():
        missing = sum(label not in r.engines for r in rows)
        if missing or len(matched[label]) != len(convs):
            notes.append(f"{label}: {missing} of ttile's {len(rows)} layers unmatched, "
                         f"{len(convs) - len(matched[label])} of its {len(convs)} "
                         f"convolution nodes unmatched")
    conv_sum = sum(r.in_context for r in rows) / 1e3
    totals["ttile"] = (totals["ttile"][0], conv_sum, totals["ttile"][0] - conv_sum)
    return Breakdown(name, threads, tuple(rows), totals, tuple(notes))


def format_breakdown(b: Breakdown) -> list[str]:
    engines = [e for e in ("onnxruntime", "OpenVINO") if any(e in r.engines for r in b.layers)]
    lines = [f"#### {b.network}, {b.threads} thread{'s' if b.threads > 1 else ''}", "",
             "| # | layer | shape | ttile fast path µs | ttile in network (hooked) µs | "
             "ttile alone µs | ttile kernel alone µs | "
             + " | ".join(f"{e} µs" for e in engines)
             + " | " + " | ".join(f"{e} / ttile" for e in engines) + " |",
             "|---|---|---|---|---|---|---|" + "---|" * (2 * len(engines))]
    for r in b.layers:
        times = " | ".join(f"{r.engines[e]:.0f}" if e in r.engines else "-" for e in engines)
        ratios = " | ".join(f"{r.engines[e] / r.in_context:.2f}" if e in r.engines else "-"
                            for e in engines)
        fast = "-" if r.fast_path is None else f"{r.fast_path:.0f}"
        lines.append(f"| {r.index} | {r.name} | {r.shape} | {fast} | {r.in_network:.0f} | "
                     f"{r.alone:.0f} | {r.kernel:.0f} | {times} | {ratios} |")
    lines += ["", "| contender | network ms (profiled run) | convolutions ms | other ms |",
              "|---|---|---|---|"]
    for label, (wall, conv, other) in b.totals.items():
        lines.append(f"| {label} | {wall:.2f} | {conv:.2f} | {other:.2f} |")
    if b.notes:
        lines += ["", "Notes: " + "; ".join(b.notes)]
    return lines + [""]
