"""Where a publication lives: a local folder (no extra package), or any URL an installed fsspec back end serves.

A place reads a file from a byte offset (an HTTP range request; a seek elsewhere), tells a file's size, and
writes a file under a temporary name before giving it its own. Every failure of the network or the back end
becomes one ShareError line naming the address, the cause and the fix.
"""
import asyncio
import functools
import os
import queue
import threading

from kdcache.store.osutil import fsync_dir

from .manifest import ShareError

EXTRA = "pip install 'kdcache[share]'"
CHUNK = 8 << 20        # bytes per read: what an interrupted transfer may fetch twice, at most
PIECE = 1 << 20        # bytes per piece of an HTTP response handed to the writer
HTTP = ("http", "https")


def is_url(s):
    return "://" in str(s)


def _fsspec(where):
    try:
        import fsspec
    except ImportError:
        raise ShareError(f"{where}: a URL needs the fsspec package, which is not installed: {EXTRA}") from None
    return fsspec


def describe(e):
    """An exception of the network or a back end as a few words."""
    import concurrent.futures
    name = type(e).__name__
    if isinstance(e, (asyncio.TimeoutError, TimeoutError, concurrent.futures.TimeoutError)):
        return "timed out"
    status = getattr(e, "status", None)
    if name == "TooManyRedirects":
        return "too many redirects (the server sends the request round in a loop)"
    if isinstance(status, int) and status:
        return f"HTTP status {status} {getattr(e, 'message', '') or ''}".rstrip()
    text = " ".join(str(e).split())[:160]
    return f"{name}: {text}" if text else name


def failure(e, where, timeout=None):
    """One ShareError for an exception raised while reaching `where`."""
    if isinstance(e, ShareError):
        return e
    if isinstance(e, FileNotFoundError):
        return ShareError(f"{where}: not found: check the address (a publication is the folder holding "
                          f"manifest.json)")
    what = describe(e)
    if what == "timed out":
        return ShareError(f"{where}: no answer within {timeout:g} s (the server stalls or is unreachable): try "
                          f"again later, or pass a longer --timeout")
    return ShareError(f"{where}: {what}: check the address and the server, then run the same command again")


class Folder:
    """A publication in a local folder."""

    def __init__(self, path):
        self.root = os.path.abspath(path)
        self.where = self.root

    def address(self, name):
        return os.path.join(self.root, name)

    def size(self, name):
        try:
            return os.stat(self.address(name)).st_size
        except FileNotFoundError:
            raise
        except OSError as e:
            raise failure(e, self.address(name)) from None

    def read_small(self, name, limit):
        with open(self.address(name), "rb") as fh:
            return fh.read(limit + 1)

    def blocks(self, name, offset, size):
        """The bytes of `name` from `offset` on, in blocks read ahead of the caller."""
        return ahead(self._chunks(name, offset))

    def _chunks(self, name, offset):
        with open(self.address(name), "rb") as fh:
            fh.seek(offset)
            while True:
                b = fh.read(CHUNK)
                if not b:
                    return
                yield b

    def exists(self, name):
        return os.path.lexists(self.address(name))

    def prepare(self):
        if os.path.exists(self.root) and not os.path.isdir(self.root):
            raise ShareError(f"{self.root} is a file: name a folder to publish into (it is created when missing)")
        os.makedirs(self.root, exist_ok=True)

    def writer(self, name):
        """(file object to write `name` through, commit()): written under a temporary name, fsynced, renamed."""
        final = self.address(name)
        tmp = os.path.join(self.root, f".{name}.tmp-{os.getpid()}")
        if os.path.lexists(tmp):
            os.unlink(tmp)  # this pid's own leftover
        fh = open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644), "wb")

        def commit():
            fh.flush()
            os.fsync(fh.fileno())
            fh.close()
            os.replace(tmp, final)
            fsync_dir(self.root)

        def abort():
            fh.close()
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        return fh, commit, abort


class Remote:
    """A publication at a URL, through fsspec (HTTP needs aiohttp; s3://, gs://, ... their own back ends)."""

    def __init__(self, url, timeout=30.0):
        fsspec = _fsspec(url)
        self.url, self.timeout = url.rstrip("/"), timeout
        self.where = self.url
        protocol = url.split("://", 1)[0].lower()
        self.http = protocol in HTTP
        options = {}
        if self.http:
            try:
                import aiohttp
            except ImportError:
                raise ShareError(f"{url}: HTTP needs the aiohttp package, which is not installed: {EXTRA}") from None
            # no limit on the whole transfer (a large file takes minutes), a limit on every wait for the server
            options["client_kwargs"] = {"timeout": aiohttp.ClientTimeout(total=None, connect=timeout,
                                                                         sock_connect=timeout, sock_read=timeout)}
        try:
            self.fs, self.root = fsspec.core.url_to_fs(self.url, **options)
        except (ImportError, ValueError) as e:
            raise ShareError(f"{url}: no fsspec back end for {protocol}:// is installed ({describe(e)}): install "
                             f"fsspec's package for it (s3fs for s3://, gcsfs for gs://, ...)") from None
        self.local = "file" in (self.fs.protocol if isinstance(self.fs.protocol, (tuple, list)) else (self.fs.protocol,))

    def address(self, name):
        return f"{self.url}/{name}"

    def _path(self, name):
        return self.address(name) if self.http else f"{self.root.rstrip('/')}/{name}"

    def _call(self, name, fn, *args, **kw):
        try:
            return fn(*args, **kw)
        except FileNotFoundError:
            raise
        except Exception as e:  # the back ends raise their own types (aiohttp's, botocore's, ...)
            raise failure(e, self.address(name), self.timeout) from None

    def size(self, name):
        info = self._call(name, self.fs.info, self._path(name))
        if info.get("size") is None:
            raise ShareError(f"{self.address(name)}: the server does not tell the file's size: serve the folder "
                             f"with a server that sends Content-Length (any static file server does)")
        return int(info["size"])

    def read_small(self, name, limit):
        return self._call(name, self.fs.cat_file, self._path(name), start=0, end=limit + 1) if not self.http \
            else self._call(name, self.fs.cat_file, self._path(name))

    def blocks(self, name, offset, size):
        """The bytes of `name` from `offset` on, in blocks read ahead of the caller: one HTTP range request streamed
        by fsspec's own HTTP session, or seeks and reads through the back end."""
        if self.http:
            return self._http_blocks(name, offset)
        return ahead(self._chunks(name, offset))

    def _chunks(self, name, offset):
        f = self._call(name, self.fs.open, self._path(name), "rb", block_size=CHUNK)
        try:
            if offset:
                f.seek(offset)
            while True:
                b = self._call(name, f.read, CHUNK)
                if not b:
                    return
                yield b
        finally:
            f.close()

    def _http_blocks(self, name, offset):
        """One GET (with a Range from `offset`) on fsspec's aiohttp session, in its event loop: the pieces arrive
        in that thread while the caller hashes and writes the ones before (a file object's read() would hand
        each piece across threads one call at a time, at half the rate)."""
        from fsspec.asyn import sync
        url = self.address(name)
        session = self._call(name, sync, self.fs.loop, self.fs.set_session)
        q, stop, end = queue.Queue(maxsize=4), threading.Event(), object()

        async def put(item):
            loop = asyncio.get_running_loop()
            while not stop.is_set():
                try:
                    await loop.run_in_executor(None, functools.partial(q.put, item, timeout=0.2))
                    return True
                except queue.Full:
                    continue
            return False

        async def run():
            try:
                headers = {"Range": f"bytes={offset}-"} if offset else {}
                async with session.get(self.fs.encode_url(url), headers=headers) as r:
                    self.fs._raise_not_found_for_status(r, url)
                    # a server that ignores ranges sends the whole file (200): the bytes staged already are skipped
                    skip = offset if r.status != 206 else 0
                    async for piece in r.content.iter_chunked(PIECE):
                        if skip:
                            drop = min(skip, len(piece))
                            piece, skip = piece[drop:], skip - drop
                            if not piece:
                                continue
                        if not await put(piece):
                            return
                await put(end)
            except BaseException as e:  # handed to the caller, raised there as one line
                await put(e)

        fut = asyncio.run_coroutine_threadsafe(run(), self.fs.loop)
        try:
            while True:
                item = q.get()
                if item is end:
                    return
                if isinstance(item, BaseException):
                    if isinstance(item, FileNotFoundError):
                        raise item
                    raise failure(item, url, self.timeout)
                yield item
        finally:
            stop.set()
            fut.cancel()

    def exists(self, name):
        return bool(self._call(name, self.fs.exists, self._path(name)))

    def prepare(self):
        if self.http:
            raise ShareError(f"{self.url}: fsspec cannot write over plain HTTP: publish into the folder the web "
                             f"server serves, or to object storage (s3://, gs://, ...)")
        self._call("", self.fs.makedirs, self.root, exist_ok=True)

    def writer(self, name):
        """(file object, commit(), abort()): a local back end writes a temporary name and moves it; object stores
        make an object visible only when it is whole, so there the file is written under its own name."""
        final = self._path(name)
        target = f"{self.root.rstrip('/')}/.{name}.tmp-{os.getpid()}" if self.local else final
        fh = self._call(name, self.fs.open, target, "wb")

        def commit():
            self._call(name, fh.close)
            if target != final:
                self._call(name, self.fs.mv, target, final)

        def abort():
            try:
                fh.close()
                if target != final:
                    self.fs.rm(target)
            except Exception:  # the error being reported is the one that matters
                pass
        return fh, commit, abort


class Flusher:
    """Writes a file's pages back to disk in a thread while more arrive, every FLUSH_BYTES: the fsync that makes the
    file durable before it is checked then waits for the last few only, not for the whole file's writeback."""

    FLUSH_BYTES = 32 << 20

    def __init__(self, fd):
        self.fd, self.pending = fd, 0
        self.wake, self.done = threading.Event(), False
        self.thread = threading.Thread(target=self._run, name="kdcache-flush", daemon=True)
        self.thread.start()

    def wrote(self, n):
        self.pending += n
        if self.pending >= self.FLUSH_BYTES:
            self.pending = 0
            self.wake.set()

    def _run(self):
        while True:
            self.wake.wait()
            self.wake.clear()
            if self.done:
                return
            try:
                os.fdatasync(self.fd)
            except OSError:
                return  # the final fsync reports what is wrong

    def stop(self):
        self.done = True
        self.wake.set()
        self.thread.join()


def place(where, *, timeout=30.0):
    """The publication at `where`: a folder, or a URL (`.../manifest.json` names its folder too)."""
    where = str(where)
    if where.endswith("/manifest.json") or where == "manifest.json":
        where = where[: -len("manifest.json")] or "."
    if is_url(where):
        return Remote(where, timeout=timeout)
    return Folder(where)


def ahead(blocks, depth=2):
    """The blocks of an iterator, read ahead in a thread: the next block arrives while this one is hashed and
    written (hashlib and file writes let the thread run). An exception of the reader is raised here."""
    q = queue.Queue(maxsize=depth)
    stop = threading.Event()
    END = object()

    def run():
        try:
            for b in blocks:
                while not stop.is_set():
                    try:
                        q.put(b, timeout=0.2)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put(END)
        except BaseException as e:  # handed to the consumer, raised there
            q.put(e)

    t = threading.Thread(target=run, name="kdcache-fetch", daemon=True)
    t.start()
    try:
        while True:
            item = q.get()
            if item is END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        t.join(timeout=5)
