"""The teacher runner: load MXNet checkpoint files and run them forward only.

Shared by the producer (cache_builder) and by the trainer's inline mode, so both compute the
teacher's logits with the same code; the producer is the one that caches them.
"""
import json
import re

import numpy as np

from .teacher_files import TeacherError, checkpoint_files


class NonFiniteOutputError(TeacherError):
    """The teacher gave NaN or Inf for some rows of a batch (`rows`, their positions in it): the
    producer names their keys; no sound teacher gives these, so nothing of the batch is cached."""

    def __init__(self, rows, batch):
        self.rows = rows
        super().__init__(f"the teacher returned NaN or Inf for {len(rows)} of {batch} samples: its weights or its "
                         f"preprocessing (--teacher-mean/--teacher-std) are broken; nothing was cached")


class Teacher:
    """A frozen MXNet model run forward only on the CPU, returning raw logits [B, classes].

    Preprocessing: the pipeline hands images in [0, 1]; the teacher's own normalisation is
    `(x - mean) / std` per channel (and an optional resize to `size`), part of its identity.
    When the network ends in a softmax (Module checkpoints with SoftmaxOutput), its input is
    taken as the output, since the cache stores raw logits.
    """

    def __init__(self, prefix, epoch=None, *, input_name=None, input_shape=None, mean=None, std=None,
                 size=None, batch_size=128):
        import mxnet as mx
        self.prefix = prefix
        self.sym_file, self.params_file, self.epoch = checkpoint_files(prefix, epoch)
        self.mean = None if mean is None else [float(v) for v in np.atleast_1d(mean)]
        self.std = None if std is None else [float(v) for v in np.atleast_1d(std)]
        if self.std is not None and any(s == 0 for s in self.std):
            raise TeacherError("--teacher-std has a zero: every channel's std must be non-zero")
        self.size = tuple(size) if size else None
        try:
            sym = mx.sym.load(self.sym_file)
        except Exception as e:  # MXNetError or JSON errors: the file is not a symbol
            raise TeacherError(f"{self.sym_file} is not a readable MXNet symbol file ({_first_line(e)}): "
                               f"re-export the teacher") from None
        try:
            saved = mx.nd.load(self.params_file)
        except Exception as e:
            raise TeacherError(f"{self.params_file} is not a readable MXNet parameter file ({_first_line(e)}): "
                               f"it is truncated or of another format; re-export the teacher") from None
        if not isinstance(saved, dict) and not len(saved):  # what a block exported before its first forward writes
            raise TeacherError(f"{self.params_file} holds no parameters: export the block after .hybridize() and one "
                               f"forward (a SymbolBlock: use the files it was imported from)")
        if not isinstance(saved, dict):
            raise TeacherError(f"{self.params_file} holds an unnamed list of arrays, not a checkpoint: save "
                               f"it with HybridBlock.export or Module.save_checkpoint")
        args, auxs = {}, {}
        for k, v in saved.items():
            kind, _, name = k.partition(":")
            if kind == "aux":
                auxs[name] = v
            else:
                args[name if kind == "arg" else k] = v
        sym, self.output_note = _logits_output(sym)
        self._input_arg = input_name
        param_names = set(args) | set(auxs)
        inputs = [n for n in sym.list_inputs() if n not in param_names and not n.endswith("_label")]
        if input_name is None:
            if len(inputs) != 1:
                raise TeacherError(f"the teacher has inputs {inputs}: pass --teacher-input NAME to say which "
                                   f"one takes the images")
            input_name = inputs[0]
        elif input_name not in inputs:
            raise TeacherError(f"--teacher-input {input_name!r} is not an input of the teacher: its inputs are {inputs}")
        missing = [n for n in sym.list_arguments() if n not in args and n != input_name]
        if missing:
            raise TeacherError(f"{self.params_file} lacks parameters {missing[:5]} the symbol needs: the files "
                               f"do not belong together")
        self.input_name = input_name
        self.input_shape = tuple(input_shape) if input_shape else None
        self.batch_size = batch_size
        self._mx = mx
        self._sym = sym
        self._args = args
        self._auxs = auxs
        self._execs = {}
        self.forwards = 0  # samples run through the teacher
        self.num_classes = None

    def _preprocess(self, x):
        if self.size is not None and tuple(x.shape[2:]) != self.size:
            nd = self._mx.nd.contrib.BilinearResize2D(self._mx.nd.array(x), height=self.size[0], width=self.size[1])
            x = nd.asnumpy()
        if self.mean is not None:
            x = x - np.asarray(self.mean, np.float32).reshape(1, -1, 1, 1)
        if self.std is not None:
            x = x / np.asarray(self.std, np.float32).reshape(1, -1, 1, 1)
        return x.astype(np.float32, copy=False)

    def _executor(self, shape):
        ex = self._execs.get(shape)
        if ex is None:
            mx = self._mx
            try:  # shape inference fails here for some layers; for others the shapes differ below
                ex = self._sym.simple_bind(mx.cpu(), grad_req="null", **{self.input_name: shape})
                why = None
            except Exception as e:
                ex, why = None, _shape_mismatch(e, self._args)
            if ex is not None:
                bound = {**ex.arg_dict, **ex.aux_dict}
                bad = [(n, tuple(v.shape), tuple(bound[n].shape)) for n, v in {**self._args, **self._auxs}.items()
                       if n in bound and tuple(bound[n].shape) != tuple(v.shape)]
                if bad:
                    n, saved, needed = bad[0]
                    why = f"its parameter {n} has shape {saved}, images of this shape need {needed}"
            if why is not None:
                raise TeacherError(f"the teacher cannot take the data set's images of shape "
                                   f"{'x'.join(map(str, shape[1:]))}: {why}; pass the teacher trained for this "
                                   f"data set, or --teacher-size HxW / --image-size HxW to resize the images")
            ex.copy_params_from(self._args, self._auxs, allow_extra_params=True)
            self._execs[shape] = ex
        return ex

    def forward(self, x):
        """Raw logits [B, classes] (float32) for a batch of pipeline images x [B, C, H, W] in [0, 1]."""
        x = self._preprocess(np.asarray(x, dtype=np.float32))
        if self.input_shape is not None and tuple(x.shape[1:]) != self.input_shape:
            raise TeacherError(f"the teacher takes inputs {self.input_shape}, the data set gives {x.shape[1:]}: "
                               f"pass --teacher-size or the matching --dataset")
        ex = self._executor(tuple(x.shape))
        ex.arg_dict[self.input_name][:] = x
        out = ex.forward(is_train=False)[0].asnumpy()
        self.forwards += x.shape[0]
        if out.ndim != 2 or out.shape[0] != x.shape[0]:
            raise TeacherError(f"the teacher's output has shape {out.shape}, not [batch, classes]: export a "
                               f"classifier whose last layer gives the logits")
        if self.num_classes is None:
            self.num_classes = out.shape[1]
        bad = ~np.isfinite(out).all(axis=1)
        if bad.any():
            raise NonFiniteOutputError(np.flatnonzero(bad), out.shape[0])
        return out

    def probe(self, x):
        """Run one small batch to learn the class count; checks the output shape early."""
        return self.forward(x[:2]).shape[1]


def check_fits(teacher, dataset, augment=None, seed=0):
    """Before the first batch: the teacher takes the data set's images and predicts its classes.

    Runs two samples, as `augment` views them (rrc:SIZE changes their size); a mistake is one
    TeacherError naming both sides (the data set's image shape and what the teacher expects),
    never MXNet's own trace."""
    from .augment import make_views
    shape = tuple(dataset.get_batch([0])[0].shape[1:])
    for what, vals in (("--teacher-mean", teacher.mean), ("--teacher-std", teacher.std)):
        if vals is not None and len(vals) not in (1, shape[0]):
            raise TeacherError(f"{what} has {len(vals)} values, the data set {dataset.name}'s images have "
                               f"{shape[0]} channel(s) ({'x'.join(map(str, shape))}): give one value, or one "
                               f"per channel")
    idx = [0, min(1, len(dataset) - 1)]
    x = make_views(dataset, idx, [0, 0], seed=seed, augment=augment)[0] if augment is not None else \
        dataset.get_batch(idx)[0]
    classes = teacher.forward(x).shape[1]
    teacher.forwards = 0
    if classes != dataset.num_classes:
        raise TeacherError(f"the teacher predicts {classes} classes, data set {dataset.name} has "
                           f"{dataset.num_classes}: pass the teacher trained for this data set (or --num-classes)")


def load_teacher(topt, batch_size):
    """The runnable teacher a pipeline.teacher_files.TeacherOptions names (imports MXNet)."""
    return Teacher(topt.prefix, topt.epoch, input_name=topt.input_name, mean=topt.mean, std=topt.std,
                   size=topt.size, batch_size=batch_size)


def _logits_output(sym):
    """If the graph ends in a softmax, return the symbol feeding it (the logits)."""
    try:
        js = json.loads(sym.tojson())
        head = js["nodes"][js["heads"][0][0]]
        op = head.get("op", "")
    except (ValueError, KeyError, IndexError):
        return sym, "output"
    if op in ("SoftmaxOutput", "softmax", "SoftmaxActivation", "log_softmax"):
        children = sym.get_children()
        if children is not None:
            return children[0], f"input of {op}"
    return sym, "output"


def _shape_mismatch(e, params):
    """What the teacher expected, from MXNet's shape-inference error: the layer and both shapes."""
    msg = str(e)
    op = re.search(r"Error in operator (\S+?):", msg)
    got = re.search(r"Provided\s*=\s*(\[[^\]]*\])\s*,\s*inferred shape\s*=\s*(\([^)]*\))", msg)
    if op and got:
        layer = re.sub(r"_fwd$", "", op.group(1))
        weight = params.get(layer + "_weight")
        return (f"its layer {layer} has weights of shape {got.group(1)}, the images give it "
                f"{got.group(2)}" + (f" (the teacher's {layer}_weight is {tuple(weight.shape)})"
                                     if weight is not None else ""))
    return _first_line(e)


def _first_line(e):
    """The informative line of an exception (MXNet's messages start with a C++ stack trace)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    lines = [ln for ln in lines if not ln.startswith(("Traceback", "File ", "[bt]", "Stack trace"))
             and not ln[:1].isdigit()]
    for ln in reversed(lines):
        if "Error" in ln or "Check failed" in ln or "error" in ln:
            return ln[:200]
    return lines[-1][:200] if lines else type(e).__name__
