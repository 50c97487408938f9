"""The root of kdcache's errors, and how a command ends on one (stdlib only: every package imports this,
the store included, which imports nothing above it).

An error kdcache raises on purpose is a KdcacheError: the input cannot be used (a bad value, a missing
or damaged file, options that disagree) and its message names the cause and the fix. A command prints
it as one line, `error: <message>`, and exits with status 2. Anything else that reaches a command is
a bug in kdcache, not in its input: the traceback, one line saying so, and exit status 70 (BUG).
"""
import functools
import sys
import traceback

USER_ERROR = 2  # the input: one line `error: ...` (argparse's status for a bad option, too)
BUG = 70  # a bug in kdcache: EX_SOFTWARE of sysexits.h (1 is verify's "NOT sound", 2 the input's)


class KdcacheError(Exception):
    """The root of every error kdcache raises on purpose: the input cannot be used as given, and the
    message names the cause and the fix. Commands print it as one line and exit with status 2.
    Subclasses keep a builtin base where callers expect one (ValueError, TypeError, FileNotFoundError,
    TimeoutError). Any other exception out of kdcache is a bug in kdcache."""


class BadTypeError(KdcacheError, TypeError):
    """An object of the wrong kind handed to kdcache's Python API (a keyword it does not take, a data set
    item that is no (image, label), inputs that are not plain data): a TypeError, as Python's own."""


def refused(e):
    """Say `e` (a KdcacheError) as the command's one line on stderr; returns USER_ERROR."""
    print(f"error: {e}", file=sys.stderr)
    return USER_ERROR


def bug(e):
    """Show `e`, an exception kdcache did not raise on purpose, as the bug it is: its traceback, then
    one line saying so; returns BUG."""
    traceback.print_exception(type(e), e, e.__traceback__)
    first = str(e).splitlines()[0] if str(e) else ""
    print(f"kdcache: internal error (a bug in kdcache, not in your input): {type(e).__name__}"
          f"{': ' + first if first else ''}; please report it with the traceback above", file=sys.stderr)
    sys.stderr.flush()
    return BUG


def as_command(main):
    """A command's main(argv, prog, ...), ending as every kdcache command ends: its return value as is;
    a KdcacheError as one line and USER_ERROR (refused); any other Exception as a bug (bug). Ctrl-C,
    SIGTERM (KeyboardInterrupt: kdcache.signals) and SystemExit (argparse's errors, status 2) pass
    through to the command's own handling."""
    @functools.wraps(main)
    def run(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except KdcacheError as e:
            return refused(e)
        except Exception as e:
            return bug(e)
    return run
