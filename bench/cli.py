"""The benchmarks' command lines: --quick, --out and --tmp declared once, and the trainer's option types."""
import argparse

from kdcache.args import Dir, Option, OutFile, Parser, add_options

# Every option is checked where it is parsed, with the value types of every kdcache command
# (kdcache.args): a mistake ends the command with one line and exit status 2 before anything is
# measured or written, not with a traceback at the end of a run.
RUN, OUTPUT = "run", "output"


def quick_option(help):
    return Option("--quick", help, action="store_true", group=RUN)


def out_option(default, what="JSON report path"):
    """--out: a file to write, checked when parsed (its folder must exist). Its `default` is not given to
    argparse, which would check it too: parse_args fills it in, and write_report creates the project's
    results folder it names when that is missing (a run from another folder writes there, as it did)."""
    return Option("--out", f"{what} (default {default})", type=OutFile(), metavar="FILE", group=OUTPUT)


def tmp_option(help):
    return Option("--tmp", help, type=Dir(), metavar="DIR", group=RUN)


def trainer_option(dest):
    """The trainer's option `dest`, its own or one it shares with the producer (imported here, not at the
    top: trainer.options loads numpy, and a benchmark fixes its threads first)."""
    from kdcache.pipeline.options import SHARED_BY_DEST
    from kdcache.trainer.options import TRAINER
    return {**SHARED_BY_DEST, **{o.dest: o for o in TRAINER}}[dest]


def like(option, help, *, group, flag=None, metavar=None, default=None):
    """A new option with the type of another command's `option` (a trainer's, say): the same values are
    allowed, without restating its range; no default unless given."""
    return Option(flag or option.flag, help, type=option.type, default=default, metavar=metavar or option.metavar,
                  short=option.short, group=group)


def parse_args(prog, description, options, argv, *, default_out=None, positionals=()):
    """(parser, options) of a benchmark command: `options` (kdcache.args.Option), each checked as it
    is parsed; positionals: (name, type, help) added before them. --out, when left out, is default_out."""
    p = Parser(prog=prog, description=description)
    for name, kind, help in positionals:
        p.add_argument(name, type=kind, help=help)
    add_options(p, options)
    args = p.parse_args(argv)
    if default_out is not None and args.out is None:
        args.out = default_out
    return p, args


def check(parser, flag, kind, value):
    """A value checked after parsing (one that depends on another option) by a value type `kind`:
    its error, as a parse error's, is one line and exit status 2."""
    try:
        return kind(value)
    except argparse.ArgumentTypeError as e:
        parser.error(f"argument {flag}: {e}")


def given_teacher(parser, args):
    """--teacher (a teacher to reuse) with --teacher-epochs (the size of one trained here) is one
    error line; a given teacher's checkpoint files must be there and readable."""
    if args.teacher is None:
        return
    if args.teacher_epochs is not None:
        parser.error("argument --teacher-epochs: it sizes the teacher trained here, and --teacher reuses one; drop "
                     "--teacher-epochs (or --teacher)")
    from kdcache.pipeline.options import resolve_teacher
    resolve_teacher(args, parser)


def check_child(parser, args, needs):
    """A child process's options: needs = {child: (dest, ...)}, what each child reads. The one chosen
    (args.child) must have all of its own, and none only other children read."""
    for dest in dict.fromkeys(d for dests in needs.values() for d in dests):
        flag = "--" + dest.replace("_", "-")
        given = getattr(args, dest) is not None
        if dest in needs[args.child] and not given:
            parser.error(f"argument {flag}: {args.child} needs it")
        if dest not in needs[args.child] and given:
            readers = " and ".join(c for c, dests in needs.items() if dest in dests)
            parser.error(f"argument {flag}: only {readers} reads it, not {args.child}; drop it")


def bench_main(argv, *, name, description, options, run, show, params=None, default_out=None, threads=1):
    """The one main routine of every benchmark (`python -m bench.NAME`).

    Parses `options` (each checked as it is parsed; a mistake is one line and exit status 2), turns them
    into the run's parameters (params(parser, args) -> p, given to run; {} without it), runs
    run(kids, args, p, work) in a scratch folder (--tmp, else a temporary one removed after) with every
    child process stopped whatever happens, stamps the report it returns (run time, CPU use of the machine,
    quick or full, the machine and its MXNet, the date, the command line: what the report already holds is
    kept), prints it with show(report), writes it to --out and names the file. Returns the exit status:
    show's (None: 0), or 2 when a step failed (its BenchError printed as one line) and nothing is written."""
    import time
    from bench.common import (command_line, cpu_between, cpu_snapshot, machine, run_in_scratch, utc_now,
                              write_report)
    ap, args = parse_args(f"python -m bench.{name}", description, options, argv, default_out=default_out)
    p = params(ap, args) if params else {}
    t_start, snap = time.perf_counter(), cpu_snapshot()
    report = run_in_scratch(args, f"kdcache-{name.replace('_', '-')}-", run, p)
    if report is None:
        return 2
    stamp = {"runtime_s": round(time.perf_counter() - t_start, 1), "cpu": cpu_between(snap, cpu_snapshot()),
             "quick": bool(getattr(args, "quick", False)), "date": utc_now(),
             "machine": machine(mxnet=True, omp_num_threads=threads),
             "command": command_line(f"python -m bench.{name}", argv)}
    for k, v in stamp.items():
        report.setdefault(k, v)
    status = show(report)
    if getattr(args, "out", None):
        write_report(args.out, report)
        print(f"Report: {args.out}")
    return status or 0
