"""The torch.fx rewrite passes of :func:`~ttile.torch.convert`: a convolution and what
follows it (batch norm folded, residual add, activation) into one :class:`TTileConv2d`,
inverted residual blocks, classifier heads, poolings, and runs of units grouped into
sequences."""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .op import _numeric_padding, _serve_check
from .modules import PoolKind, TTileConv2d, TTileInvertedResidual, TTilePool2d
from .sequence import TTileSequence


# --- what follows a convolution in the graph -------------------------------------------

_ACTIVATION_MODULES = {nn.ReLU: "relu", nn.ReLU6: "relu6", nn.LeakyReLU: "leaky_relu",
                       nn.SiLU: "silu", nn.Sigmoid: "sigmoid"}
_ACTIVATION_FUNCTIONS = {F.relu: "relu", torch.relu: "relu", F.relu6: "relu6",
                         F.leaky_relu: "leaky_relu", F.silu: "silu",
                         torch.sigmoid: "sigmoid", F.sigmoid: "sigmoid"}
_ACTIVATION_METHODS = {"relu": "relu", "relu_": "relu", "sigmoid": "sigmoid"}
_ADDS = (operator.add, operator.iadd, torch.add)


@dataclass(frozen=True)
class _Activation:
    name: str
    negative_slope: float = 0.01


def _activation_of(node, modules) -> Optional[_Activation]:
    if node.op == "call_module":
        module = modules[node.target]
        if isinstance(module, nn.Hardtanh) and not isinstance(module, nn.ReLU6):
            return (_Activation("relu6") if (module.min_val, module.max_val) == (0.0, 6.0)
                    else None)
        name = _ACTIVATION_MODULES.get(type(module))
        if name == "leaky_relu":
            return _Activation(name, float(module.negative_slope))
        return None if name is None else _Activation(name)
    if node.op == "call_function":
        if node.target is F.hardtanh:
            low = node.args[1] if len(node.args) > 1 else node.kwargs.get("min_val", -1.0)
            high = node.args[2] if len(node.args) > 2 else node.kwargs.get("max_val", 1.0)
            return _Activation("relu6") if (low, high) == (0.0, 6.0) else None
        name = _ACTIVATION_FUNCTIONS.get(node.target)
        if name == "leaky_relu":
            slope = node.args[1] if len(node.args) > 1 else node.kwargs.get(
                "negative_slope", 0.01)
            return _Activation(name, float(slope)) if isinstance(slope, (int, float)) else None
        return None if name is None else _Activation(name)
    if node.op == "call_method" and len(node.args) == 1 and not node.kwargs:
        name = _ACTIVATION_METHODS.get(node.target)
        return None if name is None else _Activation(name)
    return None


def _sole_user(node):
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _residual_of(add, tail):
    """The other operand of ``tail + other`` (a graph node), or None."""
    if add.op != "call_function" or add.target not in _ADDS or add.kwargs:
        return None
    if len(add.args) != 2:
        return None
    a, b = add.args
    other = b if a is tail else a if b is tail else None
    if other is None or other is tail or not isinstance(other, torch.fx.Node):
        return None
    return other


def _fold_batch_norm(weight, bias, bn: nn.BatchNorm2d):
    """Weights and bias of conv followed by bn (eval statistics), in float64 then float32."""
    scale = bn.weight.detach().double() if bn.weight is not None else torch.ones(
        bn.num_features, dtype=torch.float64)
    shift = bn.bias.detach().double() if bn.bias is not None else torch.zeros(
        bn.num_features, dtype=torch.float64)
    factor = scale / torch.sqrt(bn.running_var.detach().double() + bn.eps)
    w = weight.detach().double() * factor.reshape(-1, 1, 1, 1)
    b = bias.detach().double() if bias is not None else torch.zeros(
        weight.shape[0], dtype=torch.float64)
    b = (b - bn.running_mean.detach().double()) * factor + shift
    return w.float(), b.float()


def _foldable(bn, channels: int) -> bool:
    return (type(bn) is nn.BatchNorm2d and bn.num_features == channels
            and bn.track_running_stats and bn.running_mean is not None
            and bn.running_var is not None)


def _module_for(conv: nn.Conv2d, weight, bias, activation: Optional[_Activation],
                residual: bool, threads, source: str, not_fused: str = "") -> TTileConv2d:
    return TTileConv2d(weight, bias, conv.stride, _numeric_padding(conv), conv.dilation,
                       conv.groups, None if activation is None else activation.name,
                       0.01 if activation is None else activation.negative_slope,
                       residual, threads, source, not_fused)


def _replace_chain(gm: torch.fx.GraphModule, chain: list, module: nn.Module, name: str,
                   args: tuple) -> str:
    """One call of ``module`` in place of the graph nodes ``chain`` (in graph order, the
    last one giving the value the rest of the graph reads), fed ``args``; the module is
    registered under ``name`` (made unique). Returns the name."""
    while hasattr(gm, name):
        name += "_"
    gm.add_submodule(name, module)
    tail = chain[-1]
    with gm.graph.inserting_after(tail):
        new = gm.graph.call_module(name, tuple(args))
    tail.replace_all_uses_with(new)
    for old in reversed(chain):
        gm.graph.erase_node(old)
    return name


def _tidy(gm: torch.fx.GraphModule) -> None:
    """After a rewrite: check the graph, drop the modules it no longer calls, regenerate
    the code."""
    gm.graph.lint()
    gm.delete_all_unused_submodules()
    gm.recompile()


def _rewrite_graph(gm: torch.fx.GraphModule, threads) -> int:
    """Replaces each eligible conv (+ bn, + add, + activation) chain by one TTileConv2d;
    returns how many."""
    modules = dict(gm.named_modules())
    graph = gm.graph
    count = 0
    for node in list(graph.nodes):
        if node.op != "call_module" or not isinstance(modules.get(node.target), nn.Conv2d):
            continue
        conv = modules[node.target]
        if _serve_check(conv) is not None or len(node.args) != 1 or node.kwargs:
            continue
        chain, source = [node], [node.target]
        weight, bias = conv.weight, conv.bias
        tail = node
        user = _sole_user(tail)
        if (user is not None and user.op == "call_module"
                and _foldable(modules.get(user.target), conv.out_channels)):
            weight, bias = _fold_batch_norm(weight, bias, modules[user.target])
            chain.append(user)
            source.append(user.target)
            tail = user
        residual = None
        user = _sole_user(tail)
        if user is not None:
            residual = _residual_of(user, tail)
            if residual is not None:
                chain.append(user)
                source.append("add")
                tail = user
        activation = None
        user = _sole_user(tail)
        if user is not None:
            activation = _activation_of(user, modules)
            if activation is not None:
                chain.append(user)
                source.append(activation.name)
                tail = user
        module = _module_for(conv, weight, bias, activation, residual is not None, threads,
                             "+".join(source))
        args = (node.args[0],) if residual is None else (node.args[0], residual)
        name = _replace_chain(gm, chain, module, "ttile_" + node.target.replace(".", "_"),
                              args)
        modules[name] = module
        count += 1
    _tidy(gm)
    return count


def _is_pointwise(m) -> bool:
    return (isinstance(m, TTileConv2d) and tuple(m.weight.shape[2:]) == (1, 1)
            and m.stride == (1, 1) and m.padding == (0, 0) and m.dilation == (1, 1)
            and m.groups == 1)


def _fuse_inverted_residuals(gm: torch.fx.GraphModule) -> int:
    """Replaces each expand (1x1) -> depthwise (3x3, padding 1, stride 1 or 2) -> project
    (1x1, residual only from the block's input) chain of converted layers, each feeding
    only the next, by one :class:`TTileInvertedResidual`, and each depthwise -> project
    pair left (its input from anything else: MobileNetV2's first block, MobileNetV1's
    pairs) by one without an expand stage; returns how many."""
    modules = dict(gm.named_modules())
    graph = gm.graph
    count = 0
    for node in list(graph.nodes):
        project = modules.get(node.target) if node.op == "call_module" else None
        if not _is_pointwise(project) or not node.args:
            continue
        mid = node.args[0]
        if not isinstance(mid, torch.fx.Node) or mid.op != "call_module" \
                or _sole_user(mid) is not node or len(mid.args) != 1:
            continue
        depthwise = modules.get(mid.target)
        if not isinstance(depthwise, TTileConv2d) or depthwise.residual:
            continue
        e = depthwise.weight.shape[0]
        if (tuple(depthwise.weight.shape) != (e, 1, 3, 3) or depthwise.groups != e
                or depthwise.padding != (1, 1) or depthwise.dilation != (1, 1)
                or depthwise.stride not in ((1, 1), (2, 2))
                or project.weight.shape[1] != e):
            continue
        first = mid.args[0]
        expand = None
        if isinstance(first, torch.fx.Node) and first.op == "call_module" \
                and _sole_user(first) is mid and len(first.args) == 1:
            candidate = modules.get(first.target)
            if _is_pointwise(candidate) and not candidate.residual \
                    and candidate.weight.shape[0] == e:
                expand = candidate
        chain = [mid, node] if expand is None else [first, mid, node]
        block_input = first if expand is None else first.args[0]
        if not isinstance(block_input, torch.fx.Node):
            continue
        if project.residual:
            if len(node.args) != 2 or node.args[1] is not block_input \
                    or depthwise.stride != (1, 1):
                continue
        elif len(node.args) != 1:
            continue
        stages = [m for m in (expand, depthwise, project) if m is not None]
        if len({m.threads for m in stages}) != 1:
            continue
        block = TTileInvertedResidual(expand, depthwise, project)
        name = _replace_chain(gm, chain, block,
                              "ttile_block_" + chain[0].target.removeprefix("ttile_"),
                              (block_input,))
        modules[name] = block
        count += 1
    _tidy(gm)
    return count


def _is_global_average(node, modules) -> bool:
    """Whether the graph node is a global average pooling (its output is N x C x 1 x 1)."""
    if node.op == "call_module":
        module = modules.get(node.target)
        if isinstance(module, TTilePool2d):
            return module.kind is PoolKind.GLOBAL_AVERAGE
        return (type(module) is nn.AdaptiveAvgPool2d
                and module.output_size in (1, (1, 1)))
    if node.op == "call_function" and node.target is F.adaptive_avg_pool2d:
        size = node.args[1] if len(node.args) > 1 else node.kwargs.get("output_size")
        return size in (1, (1, 1), [1, 1])
    return False


def _is_flatten(node, modules) -> bool:
    """Whether the graph node flattens every dimension after the batch (``nn.Flatten()``,
    ``torch.flatten(x, 1)``, ``x.flatten(1)``)."""
    if node.op == "call_module":
        module = modules.get(node.target)
        return (type(module) is nn.Flatten and module.start_dim == 1
                and module.end_dim == -1)
    if (node.op == "call_function" and node.target is torch.flatten) or (
            node.op == "call_method" and node.target == "flatten"):
        start = node.args[1] if len(node.args) > 1 else node.kwargs.get("start_dim", 0)
        end = node.args[2] if len(node.args) > 2 else node.kwargs.get("end_dim", -1)
        return start == 1 and end == -1
    return False


def _serve_classifiers(gm: torch.fx.GraphModule, threads) -> int:
    """Replaces each classifier head - a global average pooling, a flatten, eval-mode
    dropouts, an ``nn.Linear`` (ResNet's and MobileNetV2's last layers) - by the pooling,
    a 1x1 :class:`TTileConv2d` whose weights are the linear layer's, then the flatten;
    returns how many.

    Why: after the pooling the map is N x C x 1 x 1, on which the linear layer is a 1x1
    convolution, and as one it joins the network's :class:`TTileSequence`. Left to
    torch, its call came right after ttile's last kernel with torch's own thread team
    cold, and took 200-400 us of MobileNetV2's 2.7 ms at 2 threads on a Zen 5 (65 us
    warm; ttile's kernel 45); served, MobileNetV2 went from 2.98 to 2.69 ms (A/B in one
    process)."""
    modules = dict(gm.named_modules())
    count = 0
    for node in list(gm.graph.nodes):
        linear = modules.get(node.target) if node.op == "call_module" else None
        if (type(linear) is not nn.Linear or len(node.args) != 1 or node.kwargs
                or linear.weight.dtype != torch.float32 or linear.weight.device.type != "cpu"):
            continue
        chain = [node]
        flat = node.args[0]
        while (isinstance(flat, torch.fx.Node) and flat.op == "call_module"
               and type(modules.get(flat.target)) is nn.Dropout and len(flat.args) == 1
               and _sole_user(flat) is chain[0]):
            chain.insert(0, flat)
            flat = flat.args[0]
        if (not isinstance(flat, torch.fx.Node) or _sole_user(flat) is not chain[0]
                or not _is_flatten(flat, modules) or not flat.args
                or not isinstance(flat.args[0], torch.fx.Node)
                or not _is_global_average(flat.args[0], modules)):
            continue
        k, c = linear.weight.shape
        weight = linear.weight.detach().reshape(k, c, 1, 1)
        fc = TTileConv2d(weight, linear.bias, (1, 1), (0, 0), (1, 1), 1, threads=threads,
                         source="+".join(["flatten"] + [n.target for n in chain]))
        name = "ttile_" + node.target.replace(".", "_")
        while hasattr(gm, name):
            name += "_"
        gm.add_submodule(name, fc)
        modules[name] = fc
        with gm.graph.inserting_before(flat):
            fc_node = gm.graph.call_module(name, (flat.args[0],))
        flat.args = (fc_node,) + tuple(flat.args[1:])
        node.replace_all_uses_with(flat)
        for old in reversed(chain):
            gm.graph.erase_node(old)
        count += 1
    _tidy(gm)
    return count


def _is_unit(node, modules) -> bool:
    return (node.op == "call_module" and not node.kwargs
            and isinstance(modules.get(node.target),
                           (TTileConv2d, TTileInvertedResidual, TTilePool2d))
            and all(isinstance(a, torch.fx.Node) for a in node.args))


def _serve_pooling(gm: torch.fx.GraphModule) -> int:
    """Replaces each pooling module ttile serves (:meth:`TTilePool2d.serves`) by a
    :class:`TTilePool2d`, so that a sequence can run through it; returns how many.
    (ResNet-50's whole body, stem to average pooling, is then one sequence: 1.01-1.03x
    faster at 1 and 2 threads on a Xeon model 167 than with torch's poolings between.)"""
    modules = dict(gm.named_modules())
    count = 0
    for node in list(gm.graph.nodes):
        if (node.op == "call_module" and not node.kwargs and len(node.args) == 1
                and TTilePool2d.serves(modules.get(node.target))):
            _replace_chain(gm, [node], TTilePool2d(modules[node.target]),
                           "ttile_pool_" + node.target.replace(".", "_"), node.args)
            count += 1
        elif (node.op == "call_function" and _is_global_average(node, modules)
                and node.args and isinstance(node.args[0], torch.fx.Node)):
            # F.adaptive_avg_pool2d(x, 1), as torchvision's MobileNetV2 pools
            _replace_chain(gm, [node], TTilePool2d(nn.AdaptiveAvgPool2d(1)),
                           "ttile_pool_" + node.name, (node.args[0],))
            count += 1
    _tidy(gm)
    return count


def _sequence_segments(run: list) -> list:
    """Cuts a run of consecutive units where a unit's output is read outside its
    segment (a segment hands out its last output only)."""
    segments, current = [], []
    members = set(run)
    for node in run:
        current.append(node)
        if any(user not in members for user in node.users) and node is not run[-1]:
            segments.append(current)
            members -= set(current)
            current = []
    if current:
        segments.append(current)
    return segments


def _group_sequences(gm: torch.fx.GraphModule) -> int:
    """Replaces each run of two or more consecutive ttile units (layers, blocks and
    poolings) by one :class:`TTileSequence`; returns how many."""
    modules = dict(gm.named_modules())
    graph = gm.graph
    runs, current = [], []
    for node in graph.nodes:
        if _is_unit(node, modules):
            current.append(node)
        else:
            if current:
                runs.append(current)
            current = []
    if current:
        runs.append(current)
    count = 0
    for run in runs:
        for segment in _sequence_segments(run):
            if len(segment) < 2:
                continue
            index = {node: i for i, node in enumerate(segment)}
            inputs: list = []
            for node in segment:
                for a in node.args:
                    if a not in index and a not in inputs:
                        inputs.append(a)
            steps = [(node.target, [index[a] + len(inputs) if a in index
                                    else inputs.index(a) for a in node.args])
                     for node in segment]
            sequence = TTileSequence({node.target: modules[node.target] for node in segment},
                                     steps, len(inputs))
            _replace_chain(gm, segment, sequence, f"ttile_run_{count}", tuple(inputs))
            count += 1
    _tidy(gm)
    return count
