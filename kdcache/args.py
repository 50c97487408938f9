"""The command lines' building blocks: a one-line-error parser, value types, option declarations.

A value type parses one string or says in one line what is allowed; argparse reports it as
"argument --flag: <what>" and the Parser ends the command with exit status 2. No MXNet here,
and nothing of the project: every package's command line uses these.
"""
import argparse
import math
import os
import re


class Parser(argparse.ArgumentParser):
    """argparse, with every error on one line (no usage block) and exit status 2.

    Abbreviations are refused: `--view 2` taken as `--views 2` would build another cache than the
    user meant, and a new option could silently change what an old abbreviation means."""

    def __init__(self, *args, **kw):
        kw.setdefault("allow_abbrev", False)
        super().__init__(*args, **kw)

    def error(self, message):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def fail(message):
    raise argparse.ArgumentTypeError(message)


# --- value types: parse a string, or say in one line what is allowed ----------------------------
class Allowed:
    """A value type's one-line description of what it accepts: its docstring's first paragraph."""

    def allowed(self):
        return " ".join((type(self).__doc__ or "").strip().split("\n\n")[0].split()).rstrip(".")

    format = staticmethod(str)  # the value back as a command-line word

    def coerce(self, value, flag, error=ValueError):
        """The typed value of `value` for a caller of the Python API: a string goes through this same
        parser (the command line's; never a second copy), a value already parsed is checked by formatting
        it back and parsing that. A mistake raises `error` naming `flag`, the value and what is allowed."""
        try:
            return self(value if isinstance(value, str) else self.format(value))
        except (argparse.ArgumentTypeError, TypeError, ValueError, IndexError) as e:
            raise error(f"{flag} {value!r}: {e}") from None


class Int(Allowed):
    """An integer in [lo, hi]."""

    def __init__(self, lo=None, hi=None):
        self.lo, self.hi = lo, hi

    def __call__(self, s):
        try:
            v = int(str(s).strip())
        except ValueError:
            fail(f"{s!r} is not an integer")
        if self.lo is not None and v < self.lo:
            fail(f"{v} is not allowed: it must be at least {self.lo}")
        if self.hi is not None and v > self.hi:
            fail(f"{v} is not allowed: it must be at most {self.hi}")
        return v

    def allowed(self):
        if self.hi is None:
            return f"an integer >= {self.lo}"
        return f"an integer from {self.lo} to {self.hi}"


class Float(Allowed):
    """A finite number in a range; `gt` excludes the lower bound (a temperature of 0 divides by 0), `lt`
    the upper one."""

    def __init__(self, lo=None, hi=None, *, gt=False, lt=False):
        self.lo, self.hi, self.gt, self.lt = lo, hi, gt, lt

    def __call__(self, s):
        try:
            v = float(str(s).strip())
        except ValueError:
            fail(f"{s!r} is not a number")
        if not math.isfinite(v):
            fail(f"{s} is not allowed: use {self.allowed()}")
        if self.lo is not None and (v < self.lo or (self.gt and v == self.lo)) or \
                self.hi is not None and (v > self.hi or (self.lt and v == self.hi)):
            fail(f"{s} is out of range: use {self.allowed()}")
        return v

    def allowed(self):
        lo = "" if self.lo is None else f"{'>' if self.gt else '>='} {self.lo:g}"
        if self.hi is None:
            return f"a number {lo}"
        return f"a number {lo} and {'<' if self.lt else '<='} {self.hi:g}"

    format = staticmethod(repr)


class Temperature(Float):
    """A distillation temperature T from 0.01 to 1000.

    Logits are divided by T, in float32. At T = 0.01 two logits 1 apart already differ by a factor
    exp(-100), below float32's smallest normal number: the soft target is the teacher's one-hot
    arg-max, and a smaller T changes nothing but the overflow of logits / T (1e-300 makes every
    logit infinite) and of the loss's 1 / T^2 scale. At T = 1000 logits 1 apart give probabilities
    0.1% apart: the target is uniform, and past it float32 loses the differences themselves."""

    LO, HI = 0.01, 1000.0

    def __init__(self):
        super().__init__(self.LO, self.HI)

    def __call__(self, s):
        try:
            v = float(str(s).strip())
        except ValueError:
            fail(f"{s!r} is not a number")
        if math.isfinite(v) and self.LO <= v <= self.HI:
            return v
        why = ("is not a finite number" if not math.isfinite(v) else
               "would leave no soft target (logits / T overflows float32; below 0.01 the target is already "
               "the teacher's arg-max)" if v < self.LO else
               "would make every soft target uniform (above 1000 float32 loses the logits' differences)")
        fail(f"{s} {why}: use a temperature from {self.LO:g} to {self.HI:g}")

    def allowed(self):
        return f"a number from {self.LO:g} to {self.HI:g}"


class Commas(Allowed):
    """Values separated by commas.

    Each is read by `element` (int or float) and must be finite, at least `lo` (above it with `gt`), and
    with `increasing` each above the one before. A word `element` cannot read is "use <use>, e.g.
    <example>"; a value out of bounds or order is `rule`. The list comes back as `container`."""

    def __init__(self, element, *, use, example, rule=None, lo=None, gt=False, increasing=False, container=list):
        self.element, self.use, self.example, self.rule = element, use, example, rule
        self.lo, self.gt, self.increasing, self.container = lo, gt, increasing, container

    def __call__(self, s):
        try:
            v = [self.element(x) for x in str(s).split(",")]
        except ValueError:
            fail(f"{s!r}: use {self.use}, e.g. {self.example}")
        if not all(math.isfinite(x) for x in v if isinstance(x, float)):
            fail(f"{s!r}: every value must be a finite number")
        if self.lo is not None and any(x < self.lo or (self.gt and x == self.lo) for x in v) or \
                self.increasing and any(b <= a for a, b in zip(v, v[1:])):
            fail(f"{s!r}: {self.rule}")
        return self.container(v)

    def format(self, v):
        return ",".join(repr(float(x)) if self.element is float else str(self.element(x)) for x in v)


class Floats(Commas):
    """Numbers separated by commas, one per channel."""

    def __init__(self, positive=False):
        super().__init__(float, use="numbers separated by commas, one per channel", example="0.485,0.456,0.406",
                         rule="every channel's value must be > 0 (it divides the images)",
                         lo=0 if positive else None, gt=True)


class Size(Allowed):
    """HxW with H and W at least 1."""

    def __call__(self, s):
        m = re.fullmatch(r"\s*(\d+)\s*[xX]\s*(\d+)\s*", str(s))
        if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
            fail(f"{s!r}: use HxW with H and W at least 1, e.g. 224x224")
        return int(m.group(1)), int(m.group(2))

    @staticmethod
    def format(v):
        return f"{v[0]}x{v[1]}"


class ClassNames(Allowed):
    """Two or more class names separated by commas, each once: class folder names (imagefolder) or label
    numbers (recordio); no '/' and no control character in a name."""

    def __call__(self, s):
        names = tuple(x.strip() for x in str(s).split(","))
        if any(not x or "/" in x or any(ord(c) < 32 or ord(c) == 127 for c in x) for x in names):
            fail(f"{s!r}: use class names separated by commas (a class folder's name, or a recordio label "
                 f"number), e.g. cat,dog or 0,3,7")
        twice = sorted({x for x in names if names.count(x) > 1})
        if twice:
            fail(f"{s!r}: {', '.join(map(repr, twice))} named twice: name each class once")
        if len(names) < 2:
            fail(f"{s!r}: name at least two classes (a student of one class learns nothing)")
        return names

    @staticmethod
    def format(v):
        return ",".join(v)


class Choice(Allowed):
    def __init__(self, *values):
        self.values = values

    def allowed(self):
        return " | ".join(self.values)

    def __call__(self, s):
        if s not in self.values:
            fail(f"{s!r}: use one of {', '.join(self.values)}")
        return s


class ByteSize(Allowed):
    """A size in bytes: 123, 500M, 20G (K, M, G, T: powers of 1024)."""

    def __call__(self, s):
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", str(s).lower())
        if not m:
            fail(f"{s!r}: use a size like 500M or 20G")
        return int(float(m.group(1)) * (1 << (10 * " kmgt".index(m.group(2) or " "))))


def human_bytes(b):
    """A byte count as people read it, in ByteSize's powers of 1024: 512 B, 1.5 KiB, 2.4 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if b < 1024 or unit == "TiB":
            return f"{b:.0f} {unit}" if unit == "B" else f"{b:.1f} {unit}"
        b /= 1024


class Name(Allowed):
    """Letters, digits, '-', '_' and '.' (it names a file or a folder)."""

    def __call__(self, s):
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,100}", str(s)) or s in (".", ".."):
            fail(f"{s!r}: use 1 to 100 letters, digits, '-', '_' and '.'")
        return s


class Dir(Allowed):
    """A directory (created when missing), not a file."""

    def __call__(self, s):
        if not str(s).strip():
            fail("an empty path: name a directory")
        if os.path.exists(s) and not os.path.isdir(s):
            fail(f"{s!r} is a file, not a directory: name a directory (it is created when missing)")
        return s


class Address(Allowed):
    """A Ray cluster's address: auto (the cluster `ray start` made on this host), HOST:PORT or ray://HOST:PORT."""

    def __call__(self, s):
        s = str(s).strip()
        m = re.fullmatch(r"(ray://)?([A-Za-z0-9_.-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\]):(\d{1,5})", s)
        if s != "auto" and not (m and 1 <= int(m.group(3)) <= 65535):
            fail(f"{s!r}: use auto, HOST:PORT or ray://HOST:PORT (the address `ray start --head` printed)")
        return s


class OutFile(Allowed):
    """A file to write: its folder must exist, and the path must not be a folder."""

    def __call__(self, s):
        s = str(s)
        if not s.strip() or s.endswith(os.sep) or os.path.isdir(s):
            fail(f"{s!r} names a folder, not a file: name a file in it")
        parent = os.path.dirname(os.path.abspath(s))
        if os.path.exists(parent) and not os.path.isdir(parent):
            fail(f"{s!r}: {parent} is a file, not a folder: name a file in a folder")
        if not os.path.isdir(parent):
            fail(f"{s!r}: the folder {parent} does not exist: create it first")
        return s


class Path(Allowed):
    """A path; `exists` for an input that must be there."""

    def __init__(self, exists=False):
        self.exists = exists

    def allowed(self):
        return "an existing path" if self.exists else "a path"

    def __call__(self, s):
        if not str(s).strip():
            fail("an empty path")
        if self.exists and not os.path.exists(s):
            fail(f"{s!r} does not exist")
        return s


# --- declarations ----------------------------------------------------------------------------------
class Option:
    """One option as the command lines and the Makefile see it."""

    def __init__(self, flag, help, *, type=None, default=None, metavar=None, group, make=None,
                 short=None, action=None, choices=None):
        self.flag, self.help, self.default, self.metavar, self.group = flag, help, default, metavar, group
        self.type = type if type is not None or action else Path()
        if choices:
            self.type = Choice(*choices)
        self.make, self.short, self.action = make, short, action
        self.dest = flag.lstrip("-").replace("-", "_")

    def add(self, parser, **override):
        kw = {"help": override.pop("help", self.help), "dest": self.dest}
        default = override.pop("default", self.default)
        if self.action:
            kw.update(action=self.action, default=default)
        else:
            kw.update(type=self.type, default=default, metavar=self.metavar or self.dest.upper())
            if isinstance(self.type, Choice):
                kw["metavar"] = "{" + ",".join(self.type.values) + "}"
        if default is not None and default is not False and "default" not in kw["help"]:
            kw["help"] += f" (default {self.format(default)})"
        kw.update(override)
        flags = [self.flag] + ([self.short] if self.short else [])
        parser.add_argument(*flags, **kw)

    def format(self, value):
        if self.action:
            return ""
        return self.type.format(value)

    def argv(self, value):
        """The command-line words that give this option `value` (none for an unset option)."""
        if value is None or value is False:
            return []
        if self.action:
            return [self.flag]
        return [f"{self.flag}={self.format(value)}"]  # one word: a value may start with '-'



def add_options(parser, options, **overrides):
    """Add `options` to `parser`, in argument groups titled by their `group`; overrides: {dest: {keyword: value}}."""
    groups = {}
    for o in options:
        if o.group not in groups:
            groups[o.group] = parser.add_argument_group(o.group)
        o.add(groups[o.group], **overrides.get(o.dest, {}))


def option_table(options):
    """(flag, default, allowed values, Makefile variable) per option: `kdcache options` and the README."""
    rows = []
    for o in options:
        rows.append((o.flag, "-" if o.default is None or o.default is False else o.format(o.default),
                     "a flag" if o.action else o.type.allowed(), o.make or ""))
    return rows
