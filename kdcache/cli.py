"""The `kdcache` command: one front door with a subcommand for every job.

Every command ends the same way (kdcache.errors.as_command): a KdcacheError, the input's fault, as one line
`error: ...` and exit status 2; anything else as a bug in kdcache: its traceback, one line saying so,
exit status 70."""
import sys

from kdcache.errors import as_command

# name -> (module whose main(argv, prog) runs it, what it does); main(argv, prog) of each module.
COMMANDS = {
    "teacher": ("kdcache.trainer.make_teacher", "train a teacher on a data set and export it as MXNet checkpoint files"),
    "cache": ("kdcache.cache_builder.command", "run the teacher on the CPU and fill its soft-target cache (offline, "
                                        "--online following the training schedule, or --ring)"),
    "train": ("kdcache.trainer.command", "train a student with KD from the cache (starts a producer when needed)"),
    "launch": ("kdcache.trainer.launch", "distributed training: scheduler, server and workers (dist_sync) on this "
                                 "machine"),
    "ls": ("kdcache.store.command", "list the caches in the cache directory"),
    "inspect": ("kdcache.store.command", "print all metadata of one cache"),
    "verify": ("kdcache.store.command", "check a cache's schema, flags, values and completeness (--teacher: and its "
                                 "logits against the teacher, on sampled keys)"),
    "gc": ("kdcache.store.command", "remove incomplete, damaged or unused caches and stale shared-memory rings"),
    "convert": ("kdcache.store.derive.convert", "write a cache in another codec or dtype from a finished one, without the "
                                         "teacher (prints its path)"),
    "publish": ("kdcache.share.publish", "write a finished cache, its manifest.json and a README.md card to a folder or "
                                         "URL, for others to pull"),
    "pull": ("kdcache.share.pull", "fetch a published cache (folder or URL), resumed and checked, into the cache "
                                   "directory under its fingerprint"),
    "options": ("kdcache.pipeline.options", "the options the producer and the trainer share, with their defaults"),
}
STORE_COMMANDS = ("ls", "inspect", "verify", "gc")
# The commands that write, start processes or import MXNet take Ctrl-C and SIGTERM at their safe
# points (kdcache.signals); the others as they come.
DEFERRING = ("teacher", "cache", "train", "launch")
# `kdcache verify PATH --teacher PREFIX` runs the teacher (MXNet), which the store never imports.
TEACHER_VERIFY = "kdcache.cache_builder.teacher_check"


def teacher_verify(rest):
    """Does this `kdcache verify` name a teacher (or ask for help, which explains both forms)?"""
    return any(a in ("--teacher", "-h", "--help") or a.startswith("--teacher=") for a in rest)


def usage():
    from kdcache import __version__
    width = max(map(len, COMMANDS))
    lines = ["usage: kdcache [--trust-others] COMMAND [options]   (kdcache COMMAND --help for a command's options)", "",
             f"kdcache {__version__}: knowledge distillation from a cached teacher. Commands:", ""]
    lines += [f"  {name.ljust(width)}  {what}" for name, (_, what) in COMMANDS.items()]
    lines += ["", "The same jobs run as python -m kdcache.cache_builder, python -m kdcache.trainer,",
              "python -m kdcache.trainer.launch, python -m kdcache.trainer.make_teacher and python -m kdcache.store;",
              "the Makefile's targets call this command.", "",
              "--trust-others: read caches that other users own or can write (refused otherwise: their checksums",
              "catch damage, not a planted file); the same as KDCACHE_TRUST_OTHERS=1."]
    return "\n".join(lines)


def entry():
    """The `kdcache` program (console script and python -m kdcache): signals are deferred from here
    to the process's end. main() restores the handlers it found when it returns, which a program
    calling it needs; a process that did so would take a SIGTERM arriving during the interpreter's
    exit (MXNet's destructors run for a while there) by its default action and end with -15."""
    from kdcache import signals
    signals.defer()
    return main()


def main(argv=None):
    # First thing, before any command imports MXNet: Ctrl-C and SIGTERM are taken at safe points.
    from kdcache import signals
    with signals.deferred():
        try:
            return command(argv, signals)
        except KeyboardInterrupt as e:  # one raised at a safe point outside a command's own handler
            print(f"kdcache: {signals.stop_word(e)}", file=sys.stderr)
            return signals.exit_status(e)


@as_command  # the dispatcher's own failures (each command's main ends the same way itself)
def command(argv, signals):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if argv else 2
    if argv[0] == "--version":
        from kdcache import __version__
        print(f"kdcache {__version__}")
        return 0
    if argv[0] == "--trust-others":  # NOTE [files other users can write] (kdcache.store.osutil)
        import os
        from kdcache.store.osutil import TRUST_ENV
        os.environ[TRUST_ENV] = "1"  # for this process and every one it starts
        return command(argv[1:], signals)
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"kdcache: error: unknown command {name!r}: use one of {', '.join(COMMANDS)} "
              f"(see kdcache --help)", file=sys.stderr)
        return 2
    import importlib
    if name in DEFERRING:
        return importlib.import_module(COMMANDS[name][0]).main(rest, prog=f"kdcache {name}")
    # The others read and report: Ctrl-C ends them where it lands, as Python does by default.
    with signals.interruptible():
        if name == "verify" and teacher_verify(rest):
            return importlib.import_module(TEACHER_VERIFY).main(rest, prog="kdcache verify")
        module = importlib.import_module(COMMANDS[name][0])
        if name in STORE_COMMANDS:
            return module.main([name, *rest], prog="kdcache")
        return module.main(rest, prog=f"kdcache {name}")


if __name__ == "__main__":
    sys.exit(main())
