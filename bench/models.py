"""Parameter tensors (shape, fp32) of ResNet-50, VGG-16 and Inception-v3,
written out from their published architectures (no weights are downloaded).

Which definition each table follows (the tests check the totals):
  resnet50      torchvision `resnet50` (ImageNet, 1000 classes): conv weights
                without bias, BatchNorm weight+bias (running statistics are
                buffers, not parameters), fc weight+bias.  25,557,032.
  vgg16         torchvision `vgg16` (no BatchNorm): conv and linear weights
                and biases.  138,357,544.
  inception_v3  Keras `InceptionV3` (include_top, 1000 classes): conv kernels
                without bias, BatchNormalization with scale=False (beta,
                moving_mean, moving_variance: Keras counts the moving
                statistics in its total), dense kernel+bias.  23,851,784.
Shapes follow each framework's layout (torchvision: out, in, kh, kw; Keras:
kh, kw, in, out). Only sizes matter to the replay; the layout is kept so a
reader can check the tables against the frameworks' own listings.
"""
from __future__ import annotations

import math


def resnet50(num_classes: int = 1000) -> list[tuple[str, tuple[int, ...]]]:
    t = []

    def conv(name, cin, cout, k):
        t.append((f"{name}.weight", (cout, cin, k, k)))

    def bn(name, c):
        t.append((f"{name}.weight", (c,)))
        t.append((f"{name}.bias", (c,)))

    conv("conv1", 3, 64, 7)
    bn("bn1", 64)
    cin = 64
    for li, (width, blocks) in enumerate(((64, 3), (128, 4), (256, 6), (512, 3)), start=1):
        for b in range(blocks):
            p = f"layer{li}.{b}"
            conv(f"{p}.conv1", cin, width, 1)
            bn(f"{p}.bn1", width)
            conv(f"{p}.conv2", width, width, 3)
            bn(f"{p}.bn2", width)
            conv(f"{p}.conv3", width, width * 4, 1)
            bn(f"{p}.bn3", width * 4)
            if b == 0:
                conv(f"{p}.downsample.0", cin, width * 4, 1)
                bn(f"{p}.downsample.1", width * 4)
            cin = width * 4
    t.append(("fc.weight", (num_classes, 2048)))
    t.append(("fc.bias", (num_classes,)))
    return t


def vgg16(num_classes: int = 1000) -> list[tuple[str, tuple[int, ...]]]:
    t = []
    cin, index = 3, 0
    for v in (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"):
        if v == "M":
            index += 1
            continue
        t.append((f"features.{index}.weight", (v, cin, 3, 3)))
        t.append((f"features.{index}.bias", (v,)))
        cin = v
        index += 2                          # conv, relu
    for i, (fin, fout) in zip((0, 3, 6), ((512 * 7 * 7, 4096), (4096, 4096), (4096, num_classes))):
        t.append((f"classifier.{i}.weight", (fout, fin)))
        t.append((f"classifier.{i}.bias", (fout,)))
    return t


def inception_v3(num_classes: int = 1000) -> list[tuple[str, tuple[int, ...]]]:
    t = []
    count = [0]

    def conv_bn(cin, cout, kh, kw):
        """Keras conv2d_bn: Conv2D(use_bias=False) + BatchNormalization(scale=False)."""
        count[0] += 1
        n = count[0]
        conv = "conv2d" if n == 1 else f"conv2d_{n - 1}"
        bn = "batch_normalization" if n == 1 else f"batch_normalization_{n - 1}"
        t.append((f"{conv}/kernel", (kh, kw, cin, cout)))
        for v in ("beta", "moving_mean", "moving_variance"):
            t.append((f"{bn}/{v}", (cout,)))
        return cout

    c = conv_bn(3, 32, 3, 3)
    c = conv_bn(c, 32, 3, 3)
    c = conv_bn(c, 64, 3, 3)
    c = conv_bn(c, 80, 1, 1)
    c = conv_bn(c, 192, 3, 3)
    # mixed 0, 1, 2: 35x35
    for pool in (32, 64, 64):
        b1 = conv_bn(c, 64, 1, 1)
        b5 = conv_bn(conv_bn(c, 48, 1, 1), 64, 5, 5)
        b3 = conv_bn(conv_bn(conv_bn(c, 64, 1, 1), 96, 3, 3), 96, 3, 3)
        bp = conv_bn(c, pool, 1, 1)
        c = b1 + b5 + b3 + bp
    # mixed 3: 17x17
    b3 = conv_bn(c, 384, 3, 3)
    bd = conv_bn(conv_bn(conv_bn(c, 64, 1, 1), 96, 3, 3), 96, 3, 3)
    c = b3 + bd + c
    # mixed 4..7: 17x17 with 7x1 / 1x7 factorisation
    for mid in (128, 160, 160, 192):
        b1 = conv_bn(c, 192, 1, 1)
        b7 = conv_bn(conv_bn(conv_bn(c, mid, 1, 1), mid, 1, 7), 192, 7, 1)
        x = conv_bn(c, mid, 1, 1)
        x = conv_bn(x, mid, 7, 1)
        x = conv_bn(x, mid, 1, 7)
        x = conv_bn(x, mid, 7, 1)
        bd = conv_bn(x, 192, 1, 7)
        bp = conv_bn(c, 192, 1, 1)
        c = b1 + b7 + bd + bp
    # mixed 8: 8x8
    b3 = conv_bn(conv_bn(c, 192, 1, 1), 320, 3, 3)
    x = conv_bn(c, 192, 1, 1)
    x = conv_bn(x, 192, 1, 7)
    x = conv_bn(x, 192, 7, 1)
    b7 = conv_bn(x, 192, 3, 3)
    c = b3 + b7 + c
    # mixed 9, 10: 8x8 with split 1x3 / 3x1 branches
    for _ in range(2):
        b1 = conv_bn(c, 320, 1, 1)
        x = conv_bn(c, 384, 1, 1)
        b3 = conv_bn(x, 384, 1, 3) + conv_bn(x, 384, 3, 1)
        x = conv_bn(conv_bn(c, 448, 1, 1), 384, 3, 3)
        bd = conv_bn(x, 384, 1, 3) + conv_bn(x, 384, 3, 1)
        bp = conv_bn(c, 192, 1, 1)
        c = b1 + b3 + bd + bp
    t.append(("predictions/kernel", (c, num_classes)))
    t.append(("predictions/bias", (num_classes,)))
    return t


MODELS = {"resnet50": resnet50, "vgg16": vgg16, "inception_v3": inception_v3}
PUBLISHED_TOTALS = {"resnet50": 25_557_032, "vgg16": 138_357_544, "inception_v3": 23_851_784}


def tensors(model: str) -> list[tuple[str, tuple[int, ...]]]:
    try:
        return MODELS[model]()
    except KeyError:
        raise ValueError(f"unknown model {model!r}; known: {', '.join(MODELS)}") from None


def parameter_count(model: str) -> int:
    return sum(math.prod(shape) for _, shape in tensors(model))


def nbytes(shape, itemsize: int = 4) -> int:
    return math.prod(shape) * itemsize


# Size classes for the time split (bytes of one fp32 tensor).
SIZE_CLASSES = ((4 << 10, "<=4K"), (64 << 10, "4K-64K"), (1 << 20, "64K-1M"), (16 << 20, "1M-16M"),
                (1 << 62, ">16M"))


def size_class(n: int) -> str:
    for limit, name in SIZE_CLASSES:
        if n <= limit:
            return name
    return SIZE_CLASSES[-1][1]
