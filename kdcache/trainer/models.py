"""Networks: the default digits teacher, small built-in students, and Gluon model-zoo students."""
from mxnet import gluon

from kdcache.trainer.errors import BadValueError


def _conv_teacher(features, hidden, classes, prefix):
    """The teachers' shape: the convolutions and poolings `features` ("C<width>": a 3x3 ReLU convolution,
    "P": 2x2 max pooling), flattened, then a dropout-regularised MLP with `hidden` units. The layers are
    made in this order inside the prefix's name scope: their parameter names (teacher_conv0_weight, ...)
    and the exported symbol, hence a saved teacher's files and fingerprint, follow from it."""
    net = gluon.nn.HybridSequential(prefix=prefix)
    with net.name_scope():
        for f in features:
            net.add(gluon.nn.MaxPool2D(2) if f == "P" else gluon.nn.Conv2D(int(f[1:]), 3, padding=1, activation="relu"))
        net.add(gluon.nn.Flatten(),
                gluon.nn.Dropout(0.3),
                gluon.nn.Dense(hidden, activation="relu"),
                gluon.nn.Dropout(0.3),
                gluon.nn.Dense(classes))
    return net


def digits_teacher(classes=10, prefix="teacher_"):
    """A CNN for 8x8 digits, the default teacher `make teacher` trains (99.4-99.7% test accuracy
    over seeds 0-2 with make_teacher's defaults). The features are flattened rather than
    averaged: on 4x4 maps where a stroke is matters, and GlobalAvgPool2D left it at ~97.5%."""
    return _conv_teacher(("C32", "C64", "P", "C128"), 256, classes, prefix)


def mnist_teacher(classes=10, prefix="teacher_"):
    """A LeNet-style CNN for 28x28 digits, mnist5k's teacher (~0.4M weights, 4.3M multiply-adds
    an image): two 3x3 convolutions each halved by max pooling, then a dropout-regularised MLP."""
    return _conv_teacher(("C32", "P", "C64", "P"), 128, classes, prefix)


def mlp(classes=10, hidden=32, prefix="student_"):
    """A small multi-layer perceptron student."""
    net = gluon.nn.HybridSequential(prefix=prefix)
    with net.name_scope():
        net.add(gluon.nn.Flatten(), gluon.nn.Dense(hidden, activation="relu"), gluon.nn.Dense(classes))
    return net


def mlp128(classes=10, prefix="student_"):
    """The MLP with 128 hidden units, the student bench.distill distills from the digits
    teacher (~60x fewer weights than it): big enough to take the teacher's soft targets in, small
    enough that they help (scratch ~8.6 errors of 359, distilled ~4, at 30 epochs, Adam lr 1e-2)."""
    return mlp(classes, hidden=128, prefix=prefix)


def mlp800x2(classes=10, prefix="student_"):
    """Hinton et al. 2015's MNIST student (Distilling the Knowledge in a Neural Network, section 3): two
    hidden layers of 800 ReLU units (784-800-800-10, ~1.3M weights), trained from scratch or distilled;
    bench.quality distills it on Fashion-MNIST."""
    net = gluon.nn.HybridSequential(prefix=prefix)
    with net.name_scope():
        net.add(gluon.nn.Flatten(), gluon.nn.Dense(800, activation="relu"), gluon.nn.Dense(800, activation="relu"),
                gluon.nn.Dense(classes))
    return net


def small_cnn(classes=10, width=16, prefix="student_"):
    """A small CNN student for small images."""
    net = gluon.nn.HybridSequential(prefix=prefix)
    with net.name_scope():
        net.add(gluon.nn.Conv2D(width, 3, padding=1, activation="relu"),
                gluon.nn.MaxPool2D(2),
                gluon.nn.Conv2D(2 * width, 3, padding=1, activation="relu"),
                gluon.nn.GlobalAvgPool2D(),
                gluon.nn.Dense(classes))
    return net


def small_cnn_flat(classes=10, prefix="student_"):
    """A small CNN for 28x28 images (~20k weights, ~0.35M multiply-adds an image), bench.quality's CNN student:
    small_cnn averages its 14x14 maps away and its second convolution runs at full 14x14 resolution; on
    Fashion-MNIST (one thread) it reached 65% after one epoch at ~88 s an epoch, while this one, pooling and
    striding to 7x7 maps that it flattens (where a feature is matters), reached 87.6% after two at ~15 s."""
    net = gluon.nn.HybridSequential(prefix=prefix)
    with net.name_scope():
        net.add(gluon.nn.Conv2D(16, 3, padding=1, activation="relu"),
                gluon.nn.MaxPool2D(2),
                gluon.nn.Conv2D(32, 3, strides=2, padding=1, activation="relu"),
                gluon.nn.Flatten(),
                gluon.nn.Dense(classes))
    return net


BUILTIN = {"mlp": mlp, "mlp128": mlp128, "mlp800x2": mlp800x2, "small_cnn": small_cnn,
           "small_cnn_flat": small_cnn_flat, "digits_teacher": digits_teacher}
# Networks built as teachers only (`kdcache teacher --arch`), not offered as students.
TEACHER_NETS = {"mnist_teacher": mnist_teacher}


def get_model(name, classes, prefix="student_"):
    """A built-in network, a Gluon model-zoo vision architecture (no pretrained weights), or the
    user's MODULE:FUNCTION(classes) returning a HybridBlock (its prefix is its own)."""
    from kdcache.pipeline.user_code import USER_ERRORS, PieceError, is_piece, load_piece, raised
    if is_piece(name):
        fn = load_piece(name, "--student")
        try:
            net = fn(classes)
        except USER_ERRORS as e:
            raise PieceError(f"--student {name}: {name}({classes}) {raised(e)}") from None
        if not isinstance(net, gluon.HybridBlock):
            raise PieceError(f"--student {name}: {name}({classes}) returned a {type(net).__name__}, not a Gluon "
                             f"HybridBlock (the trainer hybridizes and exports it)")
        return net
    if name in BUILTIN:
        return BUILTIN[name](classes=classes, prefix=prefix)
    from mxnet.gluon.model_zoo import vision
    try:
        return vision.get_model(name, classes=classes, pretrained=False, prefix=prefix)
    except ValueError:
        raise BadValueError(f"unknown network {name!r}: use one of {', '.join(BUILTIN)} or a Gluon model-zoo "
                            f"name such as resnet18_v1, mobilenet0.25") from None


def check_student(net, name, x, classes):
    """Run the student once on `x` (an NDArray batch of one sample): a forward that fails, or an output
    other than [1, classes] logits, is one line naming the student and the fix before training starts
    (MXNet's own error would come from inside the loss, as a traceback)."""
    import mxnet as mx
    from kdcache.pipeline.images import _mxnet_reason
    from kdcache.pipeline.user_code import PieceError, is_piece
    err = PieceError if is_piece(name) else BadValueError
    try:
        out = net(x)
        shape = tuple(out.shape) if isinstance(out, mx.nd.NDArray) else None
    except mx.base.MXNetError as e:
        raise err(f"--student {name}: its forward on one sample of shape {tuple(x.shape)} failed "
                  f"({_mxnet_reason(e)}): make it take the data set's images") from None
    if shape is None:
        raise err(f"--student {name}: returns a {type(out).__name__}, not one NDArray of logits: make its "
                  f"forward return the [batch, classes] logits only")
    if shape != (1, classes):
        width = shape[-1] if len(shape) == 2 else shape[1:]
        raise err(f"--student {name}: outputs {width} logits per sample (shape {shape} for one sample), the "
                  f"data set has {classes} classes: end it in a layer as wide as the `classes` it is "
                  f"called with (e.g. gluon.nn.Dense(classes))")
    return out


def model_identity(name):
    """What a run records of its student: the name, and for MODULE:FUNCTION its source digest."""
    from kdcache.pipeline.user_code import is_piece, piece_identity
    return piece_identity(name, "--student") if is_piece(name) else name


class StudentInput:
    """The student's own input normalisation (--student-mean, --student-std): (x - mean) / std per
    channel of the [0, 1] images, in float32 on the host; x itself when neither is given. The
    teacher's preprocessing is its own (--teacher-mean, part of the cache's fingerprint): this is
    applied to what the student sees only, so one cache serves students normalised either way. A
    checkpoint trained with it takes normalised images, as GluonCV's students do."""

    def __init__(self, mean=None, std=None, *, channels):
        import numpy as np
        for flag, vals in (("--student-mean", mean), ("--student-std", std)):
            if vals is not None and len(vals) not in (1, int(channels)):
                raise BadValueError(f"{flag} has {len(vals)} values, the images have {int(channels)} channel(s): "
                                    f"give one value, or one per channel")
        self.mean = None if mean is None else np.asarray(mean, np.float32).reshape(1, -1, 1, 1)
        self.std = None if std is None else np.asarray(std, np.float32).reshape(1, -1, 1, 1)

    def __call__(self, x):
        """The student's input for images x [B, C, H, W] (numpy)."""
        if self.mean is None and self.std is None:
            return x
        import numpy as np
        x = np.asarray(x, dtype=np.float32)
        if self.mean is not None:
            x = x - self.mean
        return x / self.std if self.std is not None else x
