"""Built-in networks: the TTile paper's benchmark layers (Fig. 8: Yolo9000 and ResNet18)
and MobileNetV2's and MobileNetV3-Large's convolutions, batch 1.

Sizes are (K, C, H=W, R=S) as printed in the paper; H is the input size. Layers marked
with * in the paper have stride 2. Padding is R // 2 on every side: 'same' for the
stride-1 layers, and the usual ResNet padding for the strided ones (torch refuses
padding='same' with stride 2). Yolo9000-23 keeps its true K = 28269; the kernels mask the
last vector instead of padding K to 28272 as the paper did.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..core.spec import ConvSpec


@dataclass(frozen=True)
class Layer:
    """One convolution layer of a network, as the generator searches it.

    The built-in layers are square with 'same'-style padding, so (k, c, hw, rs, stride)
    say everything. A layer read from a user's model (``onnx_import``) can be anything
    ConvSpec describes - non-square maps and kernels, explicit asymmetric pads,
    dilation, a fixed batch - and carries that problem in ``geometry``; its hw and rs
    then repeat the height and kernel height for listings only.
    """

    name: str
    k: int
    c: int
    hw: int
    rs: int
    stride: int = 1
    groups: int = 1   # == c == k: a depthwise layer
    #: One group's whole problem, when the fields above do not describe it.
    geometry: ConvSpec | None = None

    def __post_init__(self) -> None:
        if self.groups < 1 or self.c % self.groups or self.k % self.groups:
            raise ValueError(f"layer {self.name}: {self.groups} groups do not divide "
                             f"C={self.c} and K={self.k}")
        if self.geometry is not None and (self.geometry.k * self.groups != self.k
                                          or self.geometry.c * self.groups != self.c):
            raise ValueError(f"layer {self.name}: its geometry is not one group's problem")

    @classmethod
    def from_spec(cls, name: str, spec: ConvSpec, groups: int = 1) -> "Layer":
        """The layer of ``groups`` side-by-side copies of ``spec`` (one group's problem)."""
        return cls(name, spec.k * groups, spec.c * groups, spec.h, spec.r, spec.stride_h,
                   groups, geometry=spec)

    @property
    def depthwise(self) -> bool:
        return self.groups > 1 and self.groups == self.c == self.k

    def spec(self) -> ConvSpec:
        """One group's problem (the whole layer when groups is 1)."""
        if self.geometry is not None:
            return self.geometry
        pad = self.rs // 2
        return ConvSpec(n=1, k=self.k // self.groups, c=self.c // self.groups, h=self.hw,
                        w=self.hw, r=self.rs, s=self.rs, stride_h=self.stride,
                        stride_w=self.stride, pad_top=pad, pad_bottom=pad, pad_left=pad,
                        pad_right=pad)

    def problem(self) -> ConvSpec:
        """What the search tunes: the whole layer, a grouped one as one problem of its
        groups (``ConvSpec.groups``); a depthwise layer's one group (the depthwise
        kernel serves it, nothing is searched)."""
        spec = self.spec()
        if self.groups == 1 or self.depthwise:
            return spec
        return replace(spec, groups=self.groups)

    @property
    def flops(self) -> int:
        return self.spec().flops * self.groups


YOLO9000: tuple[Layer, ...] = (
    Layer("Yolo9000-0", 32, 3, 544, 3),
    Layer("Yolo9000-2", 64, 32, 272, 3),
    Layer("Yolo9000-4", 128, 64, 136, 3),
    Layer("Yolo9000-5", 64, 128, 136, 1),
    Layer("Yolo9000-8", 256, 128, 68, 3),
    Layer("Yolo9000-9", 128, 256, 68, 1),
    Layer("Yolo9000-12", 512, 256, 34, 3),
    Layer("Yolo9000-13", 256, 512, 34, 1),
    Layer("Yolo9000-18", 1024, 512, 17, 3),
    Layer("Yolo9000-19", 512, 1024, 17, 1),
    Layer("Yolo9000-23", 28269, 1024, 17, 1),
)

RESNET18: tuple[Layer, ...] = (
    Layer("ResNet18-1", 64, 3, 224, 7, stride=2),
    Layer("ResNet18-2", 64, 64, 56, 3),
    Layer("ResNet18-3", 64, 64, 56, 1),
    Layer("ResNet18-4", 128, 64, 56, 3, stride=2),
    Layer("ResNet18-5", 128, 64, 56, 1, stride=2),
    Layer("ResNet18-6", 128, 128, 28, 3),
    Layer("ResNet18-7", 256, 128, 28, 3, stride=2),
    Layer("ResNet18-8", 256, 128, 28, 3),
    Layer("ResNet18-9", 256, 256, 14, 3),
    Layer("ResNet18-10", 512, 512, 14, 3, stride=2),
    Layer("ResNet18-11", 512, 256, 14, 1, stride=2),
    Layer("ResNet18-12", 512, 512, 7, 3),
)



def _mobilenet_v2() -> tuple[Layer, ...]:
    """MobileNetV2 (Sandler et al. 2018, Table 2) at 224x224: each distinct convolution
    once, in network order - the stem, then per bottleneck the 1x1 expansion, the 3x3
    depthwise and the 1x1 projection - and the last 1x1 (the classifier is a matrix
    product, not a convolution)."""
    layers: list[Layer] = [Layer("MobileNetV2-0", 32, 3, 224, 3, stride=2)]
    seen: set[tuple] = set()

    def add(kind: str, k: int, c: int, hw: int, rs: int, stride: int, groups: int = 1):
        key = (k, c, hw, rs, stride, groups)
        if key not in seen:
            seen.add(key)
            layers.append(Layer(f"MobileNetV2-{len(layers)}-{kind}", k, c, hw, rs, stride,
                                groups))

    channels, size = 32, 112
    for t, c, n, s in ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2),
                       (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)):
        for i in range(n):
            stride = s if i == 0 else 1
            hidden = channels * t
            if t != 1:
                add("expand", hidden, channels, size, 1, 1)
            add("dw", hidden, hidden, size, 3, stride, groups=hidden)
            size = (size - 1) // stride + 1
            add("project", c, hidden, size, 1, 1)
            channels = c
    add("last", 1280, channels, size, 1, 1)
    return tuple(layers)


MOBILENET_V2: tuple[Layer, ...] = _mobilenet_v2()


def _mobilenet_v3() -> tuple[Layer, ...]:
    """MobileNetV3-Large (Howard et al. 2019, Table 1) at 224x224: the 3x3 stem, then per
    bottleneck the 1x1 expansion (none where it would not widen), the 3x3 or 5x5
    depthwise and the 1x1 projection, and the last 1x1 to 960 channels; each distinct
    convolution once, in network order. Left out: the squeeze-and-excitation 1x1s and the
    1x1 to 1280, which run on 1x1 maps (matrix-vector products after a pooling)."""
    layers: list[Layer] = [Layer("MobileNetV3-0", 16, 3, 224, 3, stride=2)]
    seen: set[tuple] = set()

    def add(kind: str, k: int, c: int, hw: int, rs: int, stride: int, groups: int = 1):
        key = (k, c, hw, rs, stride, groups)
        if key not in seen:
            seen.add(key)
            layers.append(Layer(f"MobileNetV3-{len(layers)}-{kind}", k, c, hw, rs, stride,
                                groups))

    channels, size = 16, 112
    # (kernel, expansion, out, stride) per bottleneck
    for rs, hidden, out, stride in ((3, 16, 16, 1), (3, 64, 24, 2), (3, 72, 24, 1),
                                    (5, 72, 40, 2), (5, 120, 40, 1), (5, 120, 40, 1),
                                    (3, 240, 80, 2), (3, 200, 80, 1), (3, 184, 80, 1),
                                    (3, 184, 80, 1), (3, 480, 112, 1), (3, 672, 112, 1),
                                    (5, 672, 160, 2), (5, 960, 160, 1), (5, 960, 160, 1)):
        if hidden != channels:
            add("expand", hidden, channels, size, 1, 1)
        add("dw", hidden, hidden, size, rs, stride, groups=hidden)
        size = (size - 1) // stride + 1
        add("project", out, hidden, size, 1, 1)
        channels = out
    add("last", 960, channels, size, 1, 1)
    return tuple(layers)


MOBILENET_V3: tuple[Layer, ...] = _mobilenet_v3()

NETWORKS: dict[str, tuple[Layer, ...]] = {"yolo9000": YOLO9000, "resnet18": RESNET18,
                                          "mobilenet_v2": MOBILENET_V2,
                                          "mobilenet_v3": MOBILENET_V3}

ALL_LAYERS: tuple[Layer, ...] = YOLO9000 + RESNET18 + MOBILENET_V2 + MOBILENET_V3


def layer(name: str) -> Layer:
    """Look a layer up by its paper name, e.g. ``layer("Yolo9000-12")``."""
    for candidate in ALL_LAYERS:
        if candidate.name.lower() == name.lower():
            return candidate
    raise KeyError(f"unknown layer {name!r}; known: {', '.join(l.name for l in ALL_LAYERS)}")
