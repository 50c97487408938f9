"""The image decoders' own warnings (libpng, libjpeg) kept off the user's terminal.

NOTE [decoder noise]. MXNet decodes with OpenCV, whose libpng and libjpeg write warnings straight to
file descriptor 2 from C: a PNG with an ICC profile libpng dislikes prints `libpng warning: iCCP: ...`
at every decode, dozens of lines an epoch that Python's own stderr never sees and no option of MXNet
turns off. `decoder_output()` points fd 2 at a private file for the span of one decode and, after it,
writes back to the real stderr every line that is not such a warning: what other threads wrote
meanwhile arrives, milliseconds late, and the decoders' noise does not. A file that cannot be decoded
is still reported, by the DatasetError naming it (the decoder's own "libpng error" line goes with the
warnings). Costs a few system calls per image (dup, dup2, fstat), ~10 us.
"""
import os
import re
import sys
import tempfile
import threading

# Lines the decoders write on their own: libpng's warnings and errors, libjpeg's "Corrupt JPEG data" and
# "Premature end of JPEG file" warnings (the decode's outcome is reported by the DatasetError).
NOISE = re.compile(rb"^(libpng (warning|error): |Corrupt JPEG data: |Premature end of JPEG file|"
                   rb"Invalid SOS parameters for sequential JPEG|Warning: unknown JFIF revision number)")

_lock = threading.RLock()
_state = {"pid": None, "sink": None, "depth": 0, "saved": None}


def _sink():
    """This process's private file for fd 2 (made anew after a fork: the parent's offset is shared)."""
    if _state["pid"] != os.getpid():
        _state.update(pid=os.getpid(), sink=tempfile.TemporaryFile(prefix="kdcache-decoder-"), depth=0, saved=None)
    return _state["sink"]


class _DecoderOutput:
    """The span of decoder_output(): re-entrant (a nested span costs a lock and a counter), one per thread
    at a time (fd 2 is the process's)."""

    def __enter__(self):
        _lock.acquire()
        if _state["depth"] and _state["pid"] == os.getpid():  # nested: the outer span does the work
            _state["depth"] += 1
            return self
        try:
            sink = _sink()
            sys.stderr.flush()  # what Python buffered before goes out before the span
            saved = os.dup(2)
        except (OSError, ValueError, AttributeError):  # no fd 2 (closed, detached): nothing to keep off it
            _state["depth"] += 1
            return self
        try:
            os.dup2(sink.fileno(), 2)
        except OSError:
            os.close(saved)
            _state["depth"] += 1
            return self
        _state.update(depth=1, saved=saved)
        return self

    def __exit__(self, *exc):
        if _state["depth"] <= 0:  # a child forked inside the span: _after_fork reset it already
            return False
        try:
            _state["depth"] -= 1
            if _state["depth"] or _state["saved"] is None:
                return False
            saved, _state["saved"] = _state["saved"], None
            try:
                sys.stderr.flush()
            except (OSError, ValueError, AttributeError):
                pass
            os.dup2(saved, 2)
            os.close(saved)
            _replay(_state["sink"])
            return False
        finally:
            _lock.release()


def _after_fork():
    """A child forked while another thread was in a span: give it its stderr back and a free lock."""
    global _lock
    saved = _state["saved"]
    if saved is not None:
        try:
            os.dup2(saved, 2)
            os.close(saved)
        except OSError:
            pass
    _state.update(pid=None, sink=None, depth=0, saved=None)
    _lock = threading.RLock()


os.register_at_fork(after_in_child=_after_fork)


def decoder_output():
    """Run a decode with fd 2 pointed away; afterwards the lines that are not decoder noise reach stderr."""
    return _DecoderOutput()


def _replay(sink):
    """Write the sink's lines that are not decoder noise to fd 2, and empty it."""
    fd = sink.fileno()
    if os.fstat(fd).st_size == 0:
        return
    os.lseek(fd, 0, os.SEEK_SET)
    data = b""
    while True:
        block = os.read(fd, 1 << 16)
        if not block:
            break
        data += block
    os.lseek(fd, 0, os.SEEK_SET)
    os.ftruncate(fd, 0)
    kept = b"".join(line for line in data.splitlines(keepends=True) if not NOISE.match(line))
    if kept:
        try:
            os.write(2, kept)
        except OSError:
            pass
