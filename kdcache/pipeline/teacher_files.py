"""The teacher as the command lines name it: its checkpoint files, its preprocessing, its identity.

No MXNet here: both sides compute the teacher's identity (digests of its files) before they
load anything; pipeline.teacher runs it.
"""
import dataclasses
import glob
import os
import re

from kdcache.pipeline.errors import PipelineError
from kdcache.store import file_digest


class TeacherError(PipelineError):
    """The teacher cannot be used; the message names the cause and the fix."""


def parse_teacher_arg(arg):
    """'PREFIX' or 'PREFIX:EPOCH' (or 'PREFIX-symbol.json') -> (prefix, epoch or None)."""
    m = re.fullmatch(r"(.+?)(?::(\d+))?", str(arg))
    prefix, epoch = m.group(1), m.group(2)
    if prefix.endswith("-symbol.json"):
        prefix = prefix[: -len("-symbol.json")]
    return prefix, (int(epoch) if epoch is not None else None)


def checkpoint_files(prefix, epoch=None):
    """(symbol file, params file, epoch) of an MXNet checkpoint; the latest epoch when none is given."""
    sym = f"{prefix}-symbol.json"
    if not os.path.isfile(sym):
        raise TeacherError(f"teacher symbol file {sym} not found: pass --teacher PREFIX[:EPOCH] where "
                           f"PREFIX-symbol.json and PREFIX-NNNN.params exist (as HybridBlock.export or "
                           f"Module.save_checkpoint write them)")
    if epoch is None:
        found = sorted(p for p in glob.glob(glob.escape(prefix) + "-[0-9][0-9][0-9][0-9].params")
                       if os.path.isfile(p))
        if not found:
            raise TeacherError(f"no parameter file {prefix}-NNNN.params next to {sym}: export the teacher's "
                               f"weights too, or pass PREFIX:EPOCH")
        params = found[-1]
        epoch = int(params[-11:-7])
    else:
        params = f"{prefix}-{epoch:04d}.params"
        if not os.path.isfile(params):
            raise TeacherError(f"teacher parameter file {params} not found: check the epoch in "
                               f"--teacher {prefix}:{epoch}")
    for path in (sym, params):
        if not os.access(path, os.R_OK):
            raise TeacherError(f"teacher file {path} is not readable (permission denied): fix its permissions")
    return sym, params, epoch


def teacher_identity(prefix, epoch=None, *, input_name=None, mean=None, std=None, size=None):
    """The teacher as the fingerprint sees it: digests of both files plus its preprocessing."""
    sym, params, epoch = checkpoint_files(prefix, epoch)
    return {"name": os.path.basename(prefix), "epoch": epoch, "symbol_sha256": file_digest(sym),
            "params_sha256": file_digest(params), "input": input_name,
            "mean": None if mean is None else [float(v) for v in mean],
            "std": None if std is None else [float(v) for v in std],
            "size": None if not size else [int(v) for v in size]}


@dataclasses.dataclass(frozen=True)
class TeacherOptions:
    """The teacher as both command lines name it: checkpoint and preprocessing (already parsed)."""
    prefix: str
    epoch: object = None
    input_name: object = None
    mean: object = None
    std: object = None
    size: object = None

    @classmethod
    def from_args(cls, args, teacher=None):
        """From --teacher PREFIX[:EPOCH] (or `teacher`) and --teacher-input/-mean/-std/-size."""
        prefix, epoch = parse_teacher_arg(teacher or args.teacher)
        return cls(prefix, epoch, args.teacher_input, args.teacher_mean, args.teacher_std, args.teacher_size)

    @property
    def arg(self):
        """The --teacher value that names this checkpoint."""
        return self.prefix if self.epoch is None else f"{self.prefix}:{self.epoch}"

    def identity(self):
        return teacher_identity(self.prefix, self.epoch, input_name=self.input_name, mean=self.mean,
                                std=self.std, size=self.size)
