"""Consecutive converted units in one call (:class:`TTileSequence`): NHWC arrays passed
from kernel to kernel, bound into a :class:`~ttile.runtime.program.Program` per input
signature while nothing it was bound from has changed, and the context verdicts that
time a layer's kernels in place in the network."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np
import torch
from torch import nn
from torch.nn.modules import module as _torch_module

from .. import _kernels
from ..core.kinds import Precision
from ..runtime.conv_layer import bindings_revision
from ..runtime import settings as _settings
from ..runtime.program import Program, Step
from ..runtime.inverted_residual import BlockVerdict, InvertedResidual
from .op import _units_revision_now
from .modules import PoolKind, TTileConv2d, TTileInvertedResidual, TTilePool2d


def _kernel_name(choice) -> str:
    """A kernel choice in a few words, for the context verdict's table."""
    if choice.tile:
        return f"{choice.kind.value} F({choice.tile}x{choice.tile})"
    if choice.blocking:
        names = [b.name.lower().replace("_", " ") for b in type(choice.blocking)
                 if b and b in choice.blocking]
        return f"{choice.kind.value} ({', '.join(names)})"
    return choice.kind.value


@dataclass(frozen=True)
class ContextVerdict:
    """One layer's context verdict (:meth:`TTileSequence.settle`): the kernels that could
    serve it, the median time of each in place in the network, and which serves
    (``chosen``, an index; 0 is the default choice)."""

    layer: str
    input_shape: tuple
    threads: int
    alternatives: tuple
    medians_us: tuple
    chosen: int

    def describe(self) -> str:
        times = ", ".join(f"{name} {us:.0f} us" for name, us in
                          zip(self.alternatives, self.medians_us))
        return f"{self.layer}: {self.alternatives[self.chosen]} ({times})"



class _BoundSequence:
    """A sequence's :class:`~ttile.runtime.program.Program` at one input signature, and
    what its steps were bound from: it may run while :meth:`holds`."""

    __slots__ = ("program", "revisions", "tensors", "units", "unit_shapes")

    def __init__(self, program: Program, tensors: tuple, units: tuple, unit_shapes: tuple):
        self.program = program
        self.revisions = _BoundSequence.current_revisions()
        # (a module's _parameters, name, the tensor there or None, its version, address)
        self.tensors = tensors
        self.units = units               # each step's unit (its index in the sequence)
        self.unit_shapes = unit_shapes   # each unit's first input's shape

    @staticmethod
    def current_revisions() -> tuple:
        """The settings generation (kernel choices), the layers' bindings revision and
        the converted units' packing revision."""
        return _settings.generation(), bindings_revision(), _units_revision_now()

    @staticmethod
    def stamps(modules) -> Optional[tuple]:
        """The ``tensors`` stamps of the modules' weights and biases now; None where one
        is an inference tensor (it counts no changes, so nothing vouches for it)."""
        stamps = []
        try:
            for module in modules:
                params = module._parameters
                for name in ("weight", "bias"):
                    t = params.get(name)
                    stamps.append((params, name, t, None if t is None else t._version,
                                   None if t is None else t.data_ptr()))
        except RuntimeError:   # "Inference tensors do not track version counter"
            return None
        return tuple(stamps)

    def holds(self) -> bool:
        """Whether every unit would still run what its step runs: no setting that
        chooses kernels changed, no layer's binding dropped or replaced (a pin, a new
        choice), no unit packed anew or told to (``repack``), and every weight and bias
        still the same tensor at the same address with no in-place change counted
        (what ``_PackedLayer`` and the blocks check before they use their packed
        copies). Run right after the previous inference's kernels, on cold caches, the
        tensors' check is most of it: about 85 us for MobileNetV2's 106 tensors at 1
        thread on a Zen 5 (13 us warm)."""
        if _BoundSequence.current_revisions() != self.revisions:
            return False
        for params, name, tensor, version, address in self.tensors:
            if params.get(name) is not tensor:
                return False
            if tensor is not None and (tensor._version != version
                                       or tensor.data_ptr() != address):
                return False
        return True


class TTileSequence(nn.Module):
    """Consecutive ttile layers, blocks and poolings (:class:`TTilePool2d`) of a traced
    model in one call: between them the activations stay NHWC numpy arrays, and no torch
    operation runs.

    Why: a torch operation right after a kernel meets caches the kernel has filled with
    its own data, and costs 15-20 us where it costs 1-2 warm (a Xeon model 167: the
    first ``torch.empty`` after a MobileNetV2 block's kernel); each layer called as a
    module runs two (the input's numpy view, the output's tensor). Run as one sequence,
    MobileNetV2's 20 layers and blocks took 2.9 ms at 2 threads against 3.3 called one by
    one. (On a Xeon model 167 at 2 threads, A/B in one process: the fused inverted
    residual blocks took MobileNetV2 from 5.6 to 4.0 ms, sequences then from 4.2 to 3.75,
    and ResNet-50 from 38.9 to 35.6.)

    After the first run at an input signature (shapes and thread count) has made every
    unit's choice, the units are bound into a :class:`~ttile.runtime.program.Program`:
    their kernels called back to back, the activations in buffers the sequence keeps,
    no layer's Python in between. Later runs at that signature go through it while it
    holds (``_BoundSequence.holds``: the same weights, packed copies, choices and
    settings); otherwise the units run one by one and are bound again. MobileNetV2 ran
    1.06x faster through its program at 1 thread and 1.10x at 2 (Zen 5), ResNet-50
    1.03x at 2.

    Inputs in torch's default layout (contiguous NCHW float32) are converted to
    channels_last once at the sequence's start, and its output back to NCHW at its end:
    each unit would otherwise run in NCHW, converting or reading NCHW layer by layer.
    On an NCHW input ResNet-50 took 1.32x its channels_last time that way, 1.09x
    converted at the ends; ResNeXt-50 1.64x and 1.05x (Xeon model 207, 1 thread).

    ``steps`` are (unit name, value indices): value i < ``inputs`` is the i-th input, and
    each step's output is the next value; the last step's output is the sequence's. The
    sequence runs its units as modules, one by one, whenever the fast path does not
    apply: inputs that are not channels_last float32 CPU tensors, tracing and
    ``torch.compile``, training mode or inputs that need gradients (the units raise
    their errors), hooks on any unit (``ttile.torch.tune`` and the benchmarks' per-layer
    timing see every call), and a block's first call at a shape (its verdict is timed
    on tensors)."""

    def __init__(self, units: dict, steps: list, inputs: int):
        super().__init__()
        for name, unit in units.items():
            self.add_module(name, unit)
        self.steps = [(name, tuple(args)) for name, args in steps]
        self.inputs = int(inputs)
        self.verdicts: list = []   # the last context verdict (settle)
        self._refresh()
        self.eval()

    def __getstate__(self):
        state = self.__dict__.copy()
        state.pop("_programs", None)   # bound kernels, buffers and a lock: made again
        return state

    def _refresh(self) -> None:
        """The steps with their modules and the values each step is the last to read."""
        # input signature -> _BoundSequence, or the count of unbound runs since binding
        # last failed (see forward)
        self._programs: dict = {}
        last_read: dict = {}
        for i, (_, args) in enumerate(self.steps):
            for a in args:
                last_read[a] = i
        self._plan = [(getattr(self, name), args,
                       tuple(a for a in set(args) if last_read[a] == i))
                      for i, (name, args) in enumerate(self.steps)]
        self._bf16_steps = self._bf16_outputs()
        # the modules whose hooks send a call down the slow path (_fast)
        self._watched = tuple(m for unit, _, _ in self._plan for m in (
            (unit, *unit._modules.values()) if type(unit) is TTileInvertedResidual
            else (unit,)))

    def __setstate__(self, state):
        super().__setstate__(state)
        self.__dict__.setdefault("verdicts", [])
        self._refresh()

    def _bf16_outputs(self) -> frozenset:
        """The steps whose output stays bf16 (half the bytes of fp32, and no rounding
        pass in the next layer): bf16 units whose every reader is one too (as its input
        or its residual), not the sequence's output. A bf16 unit is a bf16 layer; a bf16
        inverted residual block that runs on AMX (``InvertedResidual.runs_on_amx``: it
        reads and writes bits at no cost; the fp32 kernel would pay a pass for each,
        which the rounding it does anyway does not repay); and a max pooling whose
        readers are bf16 units, which passes on bits where it gets them (the maximum of
        bf16 values is one of them: ResNet's stem writes bf16 through its pooling).
        Empty without ml_dtypes, which gives numpy its bfloat16.

        The products do not change: a bf16 unit rounds its input to bf16 as it reads
        it, so handing it the rounded value is what it would have multiplied anyway. A
        residual does: a bf16 layer adds an fp32 residual as it is and a bf16 one as the
        bf16 value it is (the AMX block rounds its own either way), so a network's
        outputs move by about one bf16 rounding of its residuals, as with OpenVINO's bf16
        activations. What it saves is memory and traffic; at batch 1, where the
        activations sit in L2 or L3, MobileNetV2 on AMX blocks ran 1.01x faster at 1
        thread and 1.04x at 2 with bits between them than with fp32, ResNet-50 with bits
        through its max pooling 0.99-1.04x (interleaved; Xeon model 207)."""
        try:
            import ml_dtypes  # noqa: F401
        except ImportError:
            return frozenset()
        readers: dict = {}
        for i, (_, args) in enumerate(self.steps):
            for a in args:
                readers.setdefault(a, []).append(i)
        last = self.inputs + len(self.steps) - 1

        def read_by_bf16_units(step: int) -> bool:
            value = self.inputs + step
            return (value != last and bool(readers.get(value))
                    and all(bf16_unit(j) for j in readers[value]))

        def bf16_unit(step: int) -> bool:
            unit = getattr(self, self.steps[step][0])
            kind = type(unit)
            if kind is TTileConv2d:
                return unit.precision is Precision.BF16
            if kind is TTileInvertedResidual:
                return unit.bf16 and InvertedResidual.runs_on_amx(unit.precision)
            return (kind is TTilePool2d and unit.kind is PoolKind.MAX
                    and read_by_bf16_units(step))

        bits: set = set()
        for i, (_, args) in enumerate(self.steps):
            unit = getattr(self, self.steps[i][0])
            if type(unit) is TTilePool2d:   # passes on what it gets
                if args[0] - self.inputs in bits and bf16_unit(i):
                    bits.add(i)
            elif bf16_unit(i) and read_by_bf16_units(i):
                bits.add(i)
        return frozenset(bits)

    def _fast(self, xs) -> bool:
        if self.training or torch.compiler.is_compiling():
            return False
        grad = torch.is_grad_enabled()
        for x in xs:
            if (type(x) is not torch.Tensor or x.dtype is not torch.float32 or not x.is_cpu
                    or x.ndim != 4 or (grad and x.requires_grad)
                    or not x.is_contiguous(memory_format=torch.channels_last)):
                return False
        if _torch_module._global_forward_hooks or _torch_module._global_forward_pre_hooks:
            return False
        for module in self._watched:   # hooks on a unit or a block's layer see each call
            if module._forward_hooks or module._forward_pre_hooks:
                return False
        return True

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        nchw = self._nchw(xs)
        if nchw:   # once here, rather than in every unit; the output as torch gives it
            xs = tuple(x.contiguous(memory_format=torch.channels_last) for x in xs)
        y = self._fast_forward(xs) if self._fast(xs) else self._one_by_one(xs)
        return y.contiguous() if nchw else y

    @staticmethod
    def _nchw(xs) -> bool:
        """Whether the inputs are float32 CPU images in torch's default layout (NCHW
        contiguous, some not channels_last), which the sequence converts at its ends."""
        if torch.compiler.is_compiling():
            return False
        return all(type(x) is torch.Tensor and x.dtype is torch.float32 and x.is_cpu
                   and x.ndim == 4 and x.is_contiguous() for x in xs) and not all(
            x.is_contiguous(memory_format=torch.channels_last) for x in xs)

    def _fast_forward(self, xs) -> torch.Tensor:
        """The fast path on channels_last inputs (``_fast``)."""
        threads = torch.get_num_threads()
        values: list = [x.numpy().transpose(0, 2, 3, 1) for x in xs]
        key = (tuple(v.shape for v in values), threads)
        bound = self._programs.get(key)
        holds = type(bound) is _BoundSequence and bound.holds()
        if holds:
            y = bound.program.run(values)
            if y is not None:   # (None: another thread is running it)
                return torch.from_numpy(y.transpose(0, 3, 1, 2))
        y = self._unbound(values, threads)
        if y is None:   # a verdict to make on tensors: this call goes slow
            return self._one_by_one(xs)
        if not holds:
            # bound after a run that made every choice; after a failed binding,
            # again every BIND_RETRY runs (a background tuning may have finished)
            if type(bound) is int and (bound + 1) % self.BIND_RETRY:
                self._programs[key] = bound + 1
            else:
                self._programs.pop(key, None)
                bound = self._bind(key[0], threads)
                self._keep(key, bound or 0)
        return torch.from_numpy(y.transpose(0, 3, 1, 2))

    #: Input signatures a sequence keeps a program for.
    MAX_PROGRAMS = 8
    #: Activation memory a sequence keeps for its programs beyond the newest one (each
    #: keeps about the peak of what a call of it has live at once).
    MAX_PROGRAM_BYTES = 256 << 20
    #: Unbound runs between two tries to bind a sequence that could not be bound.
    BIND_RETRY = 16

    def _keep(self, key, entry) -> None:
        """Keep ``entry`` (a bound program, or a count of runs since binding failed) for
        ``key``, the oldest signatures dropped beyond MAX_PROGRAMS and
        MAX_PROGRAM_BYTES."""
        programs = self._programs
        programs[key] = entry
        def kept_bytes():
            return sum(p.program.buffer_bytes for p in list(programs.values())
                       if type(p) is _BoundSequence)
        for old in list(programs):
            if old == key:
                continue
            if len(programs) <= self.MAX_PROGRAMS and kept_bytes() <= \
                    self.MAX_PROGRAM_BYTES + (entry.program.buffer_bytes
                                              if type(entry) is _BoundSequence else 0):
                break
            programs.pop(old, None)

    def _unbound(self, values: list, threads: int, shapes: Optional[list] = None,
                 elapsed: Optional[list] = None) -> Optional[np.ndarray]:
        """The units called one by one on NHWC arrays (each layer's own checks and
        choices): the output, or None where a unit's verdict is still to be made on
        tensors. With ``shapes`` and ``elapsed`` (:meth:`_timed_pass`), each unit's
        first input shape and its seconds are appended to them."""
        timed = elapsed is not None
        bf16_steps = self._bf16_steps
        for step, (unit, args, done) in enumerate(self._plan):
            if timed:
                shapes.append(values[args[0]].shape)
                t0 = time.perf_counter()
            if type(unit) is TTileConv2d:
                residual = values[args[1]] if len(args) > 1 else None
                y = (unit.run_nhwc(values[args[0]], residual, threads, bf16_out=True)
                     if step in bf16_steps else
                     unit.run_nhwc(values[args[0]], residual, threads))
            elif type(unit) is TTileInvertedResidual:
                y = unit.run_nhwc(values[args[0]], threads, step in bf16_steps)
            else:
                y = unit.run_nhwc(values[args[0]], threads)
            if timed:
                elapsed.append(time.perf_counter() - t0)
            if y is None:
                return None
            for a in done:
                if a >= self.inputs:
                    values[a] = None   # the memory goes back as soon as it can
            values.append(y)
        return values[-1]

    def _bind(self, shapes: tuple, threads: int) -> Optional["_BoundSequence"]:
        """The units bound to their kernels for inputs of ``shapes`` at ``threads``, as
        the unbound run just made them choose (a :class:`~ttile.runtime.program.Program`
        and what it was bound from), or None where a unit has no final binding yet."""
        index = list(range(self.inputs))   # the sequence's values -> the program's
        shapes = list(shapes)               # the program's values' shapes
        steps: list = []
        layers: list = []
        blocks: list = []
        pending: list = []   # fused blocks: (step number, block, x shape, threads)

        def add(call, source: int, residual: int, out_shape, bits: bool = False) -> int:
            steps.append(Step(call, source, residual, tuple(out_shape), bits))
            shapes.append(tuple(out_shape))
            return len(shapes) - 1

        def add_layer(unit: TTileConv2d, source: int, residual: int,
                      bf16_out: bool = False) -> Optional[int]:
            t = unit.threads or threads
            layer = unit._packed.layer("NHWC")
            bound = layer.bound_nhwc(shapes[source], t, residual >= 0, bf16_out)
            if bound is None:
                return None
            layers.append(unit)
            return add(bound.bound_kernel[0], source, residual, bound.plan.out_shape,
                       bf16_out)

        step_units: list = []
        unit_shapes: list = []
        for u, (unit, args, _) in enumerate(self._plan):
            source = index[args[0]]
            unit_shapes.append(shapes[source])
            residual = index[args[1]] if len(args) > 1 else -1
            kind = type(unit)
            if kind is TTileConv2d:
                value = add_layer(unit, source, residual, u in self._bf16_steps)
            elif kind is TTilePool2d:
                call, out_shape = unit.bound_call(shapes[source], threads)
                value = add(call, source, -1, out_shape, u in self._bf16_steps)
            else:
                t = unit._modules["project"].threads or threads
                key = (shapes[source], t)
                plan = unit.plans.get(key)
                if plan is None:
                    return None
                bits = u in self._bf16_steps
                if (plan.verdict is BlockVerdict.FUSED
                        and InvertedResidual.unsupported() is None):
                    fused = unit._block()
                    blocks.append(unit)
                    pending.append((len(steps), fused, shapes[source], t))
                    value = add(None, source, -1, fused.output_shape(shapes[source]), bits)
                else:
                    value = (source if unit.expand is None
                             else add_layer(unit.expand, source, -1))
                    if value is not None:
                        value = add_layer(unit.depthwise, value, -1)
                    if value is not None:
                        value = add_layer(unit.project, value,
                                          source if unit.project.residual else -1, bits)
            if value is None:
                return None
            step_units += [u] * (len(steps) - len(step_units))
            index.append(value)
        modules = list(layers)
        for unit in blocks:
            modules += unit.layers
        tensors = _BoundSequence.stamps(modules)
        if tensors is None:
            return None
        if pending:   # the fused blocks share one scratch buffer: steps run one by one
            floats = max(block.scratch_floats(shape, t) for _, block, shape, t in pending)
            buffer = _kernels.empty_aligned((floats,))
            for (i, block, shape, t), unit in zip(pending, blocks):
                call, _ = block.bound_call(shape, t, buffer)
                steps[i] = replace(steps[i], call=call)
        return _BoundSequence(Program(self.inputs, steps), tensors, tuple(step_units),
                              tuple(unit_shapes))

    def settle(self, *xs: torch.Tensor, rounds: int = 8, margin: float = 0.03,
               seed: int = 0) -> list["ContextVerdict"]:
        """The network's context verdict: each layer's alternatives (``Conv2d.
        alternatives``: a Winograd layer's other tile and direct kernel, a searched
        kernel's generic one, the generic kernel's other blockings) timed in place, in
        this sequence's fast path on ``xs``, and the fastest kept (``Conv2d.pin``) where
        it beats the default by more than ``margin`` in median; returns the verdicts,
        one per layer with alternatives. Interrupted, it leaves every layer on its
        default.

        Why in place: a layer alone runs with its weights and input warm; in a network
        its weights come from memory and its input from the previous layer, and the
        order of the kernels can change (``routes.alternatives``). Each round runs the
        whole sequence, every layer on one of its alternatives (layer i on alternative
        (round + offset_i) mod n_i, the offsets seeded), so each alternative is timed
        between the same neighbours as the others; the first rounds, one per
        alternative, pack the weights and are not counted. ``rounds`` timed calls per
        alternative. Nothing is settled (an empty list) where the fast path does not
        apply.

        On a Xeon model 167 it took 0.8-1.4 s for ResNet-50 and put its 14x14 256->256
        3x3 layers on Winograd F(2x2), its 7x7 and 14x14 1x1 layers on half groups, and at
        2 threads its 56x56 and 28x28 1x1 layers on the generic kernel: ResNet-50 took
        0.95x the time at 1 thread and 0.94x at 2 (with and without its pins,
        interleaved)."""
        if not self._fast(xs):
            return []
        threads = torch.get_num_threads()
        first = self._timed_pass(xs, threads)   # the input shape each layer meets
        if first is None:
            return []
        units = {}   # step: (layer, input shape, threads, alternatives)
        for i, (unit, _, _) in enumerate(self._plan):
            if type(unit) is TTileConv2d:
                shape, t = first[0][i], unit.threads or threads
                layer = unit._packed.layer("NHWC")
                layer.pin(shape, t, None)
                alternatives = layer.alternatives(shape, t)
                if len(alternatives) > 1:
                    units[i] = (layer, shape, t, alternatives)
        if not units:
            return []
        rng = np.random.default_rng(seed)
        offsets = {i: int(rng.integers(len(alts))) for i, (*_, alts) in units.items()}
        widest = max(len(alts) for *_, alts in units.values())
        times: dict = {(i, a): [] for i, (*_, alts) in units.items()
                       for a in range(len(alts))}
        try:
            for round_ in range(widest * (rounds + 1)):
                picks = {i: (round_ + offsets[i]) % len(alts)
                         for i, (*_, alts) in units.items()}
                for i, (layer, shape, t, alts) in units.items():
                    layer.pin(shape, t, alts[picks[i]] if picks[i] else None)
                _, elapsed = self._timed_pass(xs, threads)
                if round_ >= widest:   # the first round of each alternative packs
                    for i, a in picks.items():
                        times[(i, a)].append(elapsed[i])
        except BaseException:
            for layer, shape, t, _ in units.values():
                layer.pin(shape, t, None)
            raise
        verdicts = []
        for i, (layer, shape, t, alts) in units.items():
            medians = tuple(statistics.median(times[(i, a)]) for a in range(len(alts)))
            best = min(range(len(alts)), key=medians.__getitem__)
            if medians[best] >= (1.0 - margin) * medians[0]:
                best = 0
            layer.pin(shape, t, alts[best] if best else None)
            layer.forget_packed(keep=alts[best].choice)
            verdicts.append(ContextVerdict(
                layer=self.steps[i][0], input_shape=tuple(shape), threads=t,
                alternatives=tuple(_kernel_name(a.choice) for a in alts),
                medians_us=tuple(round(m * 1e6, 1) for m in medians), chosen=best))
        return verdicts

    def _timed_pass(self, xs, threads: int) -> Optional[tuple[list, list]]:
        """One run of the fast path for :meth:`settle` and the benchmarks: each step's
        first input shape and its time in seconds, or None where a unit's verdict is
        still to be made on tensors. Through the program while one holds (a unit's
        time is then its kernels' calls alone), else unit by unit."""
        values: list = [x.numpy().transpose(0, 2, 3, 1) for x in xs]
        bound = self._programs.get((tuple(v.shape for v in values), threads))
        if type(bound) is _BoundSequence and bound.holds():
            times: list = []
            if bound.program.run(values, times) is not None:
                elapsed = [0.0] * len(self._plan)
                for unit, seconds in zip(bound.units, times):
                    elapsed[unit] += seconds
                return list(bound.unit_shapes), elapsed
        shapes: list = []
        elapsed: list = []
        if self._unbound(values, threads, shapes, elapsed) is None:
            return None
        return shapes, elapsed

    def _one_by_one(self, xs) -> torch.Tensor:
        values = list(xs)
        for unit, args, _ in self._plan:
            values.append(unit(*(values[a] for a in args)))
        return values[-1]

    def extra_repr(self) -> str:
        return f"{len(self.steps)} steps, {self.inputs} input{'s' if self.inputs > 1 else ''}"
