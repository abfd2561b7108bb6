"""The front door: :func:`convert` (trace, rewrite, or swap modules where the model does
not trace), :func:`tune` (each served layer tuned on an example input, the table
printed), :func:`repack` and :func:`served_layers`."""
from __future__ import annotations

import sys
import warnings
from typing import Optional, Union

import torch
from torch import nn

from ..core.kinds import Precision
from ..runtime.api import plan as _ttile_plan
from ..runtime.bf16 import precision_of
from ..runtime.inverted_residual import BlockVerdict
from .op import _output_size, _serve_check
from .modules import TTileConv2d, TTileInvertedResidual
from .sequence import TTileSequence
from .rewrite import (_fuse_inverted_residuals, _group_sequences, _module_for, _rewrite_graph,
                      _serve_classifiers, _serve_pooling)
from .table import format_table


def _swap_modules(model: nn.Module, threads, not_fused: str, prefix: str = "") -> int:
    """The fallback for models that do not trace: each eligible nn.Conv2d alone
    (``not_fused`` says why nothing around it was fused)."""
    count = 0
    for name, child in model.named_children():
        path = f"{prefix}{name}"
        if isinstance(child, nn.Conv2d) and _serve_check(child) is None:
            setattr(model, name, _module_for(child, child.weight, child.bias, None, False,
                                             threads, path, not_fused))
            count += 1
        else:
            count += _swap_modules(child, threads, not_fused, path + ".")
    return count


def repack(model: nn.Module) -> None:
    """Have every ttile layer of ``model`` pack its weights again on its next call: for
    writes through ``.data``, which torch's version counter does not see. (Other changes
    of weights and biases are noticed by themselves.)"""
    for _, module in served_layers(model):
        module.repack()
    for module in model.modules():
        if isinstance(module, TTileInvertedResidual):
            module.repack()


def served_layers(model: nn.Module) -> list[tuple[str, TTileConv2d]]:
    """The (name, module) pairs of a converted model's ttile layers."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, TTileConv2d)]


def convert(model: nn.Module, *, inplace: bool = False, threads: Optional[int] = None,
            example_input: Optional[torch.Tensor] = None, trace: bool = True,
            fuse_blocks: bool = True, sequences: bool = True,
            progress: bool = True, settle: bool = True,
            precision: Union[str, Precision] = Precision.FP32) -> nn.Module:
    """The model with its eligible convolutions served by ttile (see the module's doc).

    Args:
        model: a module in eval mode (``model.eval()``); a model in training mode is
            refused, since ttile computes no gradients.
        inplace: change ``model`` itself (module swap only: a traced model is a new
            ``GraphModule`` either way) rather than a deep copy.
        threads: threads of each ttile call (None: ``torch.get_num_threads()`` at call).
        example_input: an input to run once after conversion: every convolution's shape is
            then tuned up front (a progress bar on stderr) and a table of what serves each
            layer printed, so that later calls run no tuning.
        trace: try ``torch.fx`` (fusing batch norms, residual adds and activations); False
            swaps modules only.
        fuse_blocks: serve inverted residual blocks (1x1 -> 3x3 depthwise -> 1x1) as one
            :class:`TTileInvertedResidual` each (traced models only).
        sequences: run each run of consecutive ttile layers, blocks and poolings as
            one :class:`TTileSequence` (traced models only), NHWC arrays between them
            (max and global average poolings become :class:`TTilePool2d` for that).
            A classifier after a global average pooling becomes a 1x1 layer either way.
        progress: show the progress bar and the table (with ``example_input``).
        settle: with ``example_input``, make each sequence's context verdict
            (:meth:`TTileSequence.settle`): the layers' alternative kernels timed in
            place in the network, the fastest kept.
        precision: "fp32", or "bf16": every convolution's input and weights rounded to
            bf16, fp32 accumulation and epilogues (see :func:`ttile.conv2d`), on the
            AMX or AVX512_BF16 kernels where the CPU has them; inside a sequence the
            activations between bf16 layers, AMX inverted residual blocks and max
            poolings stay bf16 (half the bytes; a residual read from them is rounded too,
            as in OpenVINO's bf16). Fused inverted residual
            blocks run their 1x1 stages on AMX where it may run (else their fp32 kernel on
            bf16-rounded weights and input), grouped layers the bf16 kernels in
            super-groups (see ``ttile.runtime.bf16``), and depthwise layers fp32
            kernels on rounded values.
    """
    precision = precision_of(precision)
    if not isinstance(model, nn.Module):
        raise TypeError(f"convert takes an nn.Module, got {type(model).__name__}")
    if model.training:
        raise RuntimeError("ttile.torch.convert serves inference only and the model is in "
                           "training mode: call model.eval() first (batch norms are folded "
                           "with their running statistics; ttile computes no gradients)")
    if not inplace:
        import copy
        model = copy.deepcopy(model)
    converted = None
    not_fused = "trace=False"
    if trace:
        try:
            # a GraphModule is a graph already (ttile.onnx builds one whose onnxruntime
            # modules are not traceable): rewritten as it is
            gm = model if isinstance(model, torch.fx.GraphModule) else \
                torch.fx.symbolic_trace(model)
        except Exception as exc:   # data-dependent control flow and the like: swap modules
            gm = None
            first_line = (str(exc).strip().splitlines() or [""])[0]
            not_fused = f"torch.fx could not trace the model ({type(exc).__name__}: " \
                        f"{first_line[:200]})"
            warnings.warn(f"ttile.torch.convert: {not_fused}; each convolution is served "
                          f"alone, without folding batch norms or fusing residual adds and "
                          f"activations (trace=False asks for this without the warning)",
                          RuntimeWarning, stacklevel=2)
        if gm is not None:
            _rewrite_graph(gm, threads)
            if fuse_blocks:
                _fuse_inverted_residuals(gm)
            if sequences:
                _serve_pooling(gm)
            _serve_classifiers(gm, threads)
            _set_precision(gm, precision)
            if sequences:
                _group_sequences(gm)
            converted = gm.eval()
    if converted is None:
        _swap_modules(model, threads, not_fused)
        converted = model
        _set_precision(model, precision)
    if example_input is not None:
        tune(converted, example_input, progress=progress, settle=settle)
    return converted


def _set_precision(model: nn.Module, precision: Precision) -> None:
    """Every TTileConv2d of ``model`` to multiply in ``precision`` (before sequences are
    grouped: a layer's packed state is made anew)."""
    if precision is Precision.FP32:
        return
    for module in model.modules():
        if isinstance(module, TTileConv2d):
            module.precision = precision
            module._attach()
        elif isinstance(module, TTileInvertedResidual):
            module.precision = precision


def tune(model: nn.Module, example_input: torch.Tensor, *, progress: bool = True,
         settle: bool = True):
    """Runs the converted model once on ``example_input`` (a tuple: one per input;
    tuning every ttile layer's shape on its first call, by the tuning policy of ``ttile.set_tuning``), then with
    ``settle`` makes each :class:`TTileSequence`'s context verdict on the inputs it met
    (kept in its ``verdicts``), and prints which kernel serves each layer; returns the
    rows of that table."""
    layers = served_layers(model)
    blocks = [(name, m) for name, m in model.named_modules()
              if isinstance(m, TTileInvertedResidual)]
    seen: list = []
    bar = None
    if progress:
        try:
            from tqdm import tqdm
            bar = tqdm(total=len(layers), desc="ttile: tuning layers", unit="layer",
                       file=sys.stderr)
        except ImportError:
            bar = None

    def before(module, args):
        x = args[0]
        layout = ("NHWC" if x.is_contiguous(memory_format=torch.channels_last) else "NCHW")
        seen.append((module, tuple(x.shape), layout, args[1] is not None if len(args) > 1
                     else False))

    def after(module, args, output):
        if bar is not None:
            bar.update(1)

    def block_after(module, args, output):
        x = args[0]
        layout = ("NHWC" if x.is_contiguous(memory_format=torch.channels_last) else "NCHW")
        threads = module.project.threads or torch.get_num_threads()
        shape = tuple(x.shape)
        plan = module.plans.get(((shape[0], shape[2], shape[3], shape[1]), threads))
        if plan is not None and plan.verdict is BlockVerdict.FUSED:
            seen.append((module, shape, layout, plan))
            if bar is not None:
                bar.update(3)

    handles = []
    for _, module in layers:
        handles.append(module.register_forward_pre_hook(before))
        handles.append(module.register_forward_hook(after))
    for _, module in blocks:
        handles.append(module.register_forward_hook(block_after))
    sequence_inputs: list = []
    for module in model.modules():
        if isinstance(module, TTileSequence):
            handles.append(module.register_forward_pre_hook(
                lambda module, args: sequence_inputs.append((module, args))))
    try:
        with torch.no_grad():
            model(*example_input) if isinstance(example_input, tuple) else model(example_input)
    finally:
        for handle in handles:
            handle.remove()
        if bar is not None:
            bar.close()
    verdicts = []
    if settle:
        for sequence, _ in sequence_inputs:
            sequence.verdicts = []
        for sequence, args in sequence_inputs:   # a sequence called twice: both inputs
            found = sequence.settle(*args)
            sequence.verdicts += found
            verdicts += found
    rows = []
    names = {id(m): name for name, m in layers + blocks}
    for module, shape, layout, residual in seen:
        if isinstance(module, TTileInvertedResidual):
            rows.append((names.get(id(module), "?"), module.source, shape, layout, residual,
                         ""))
            continue
        w_shape = tuple(module.weight.shape)
        n, c, h, w = shape
        x_shape = shape if layout == "NCHW" else (n, h, w, c)
        if layout == "NHWC":
            w_shape = (w_shape[2], w_shape[3], w_shape[1], w_shape[0])
        k, _, r, s = module.weight.shape
        ho = _output_size(h, module.padding[0], module.dilation[0], r, module.stride[0])
        wo = _output_size(w, module.padding[1], module.dilation[1], s, module.stride[1])
        out_shape = (n, k, ho, wo) if layout == "NCHW" else (n, ho, wo, k)
        kp = _ttile_plan(x_shape, w_shape, None if module.bias is None else module.bias.shape,
                         module.stride, module.padding, module.dilation, module.groups,
                         layout=layout, threads=module.threads or torch.get_num_threads(),
                         activation=module.activation, negative_slope=module.negative_slope,
                         residual=out_shape if residual else None, prepacked=True,
                         precision=module.precision)
        rows.append((names.get(id(module), "?"), module.source, shape, layout, kp,
                     module.not_fused))
    if progress:
        print(format_table(rows), file=sys.stderr)
        changed = [v for v in verdicts if v.chosen]
        if verdicts:
            print(f"In place in the network, {len(changed)} of {len(verdicts)} layers with "
                  f"alternatives run faster on another kernel" + (":" if changed else "."),
                  file=sys.stderr)
        for verdict in changed:
            print(f"  {verdict.describe()}", file=sys.stderr)
    return rows
