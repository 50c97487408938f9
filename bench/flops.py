"""Per-core teacher figures that can be trusted: multiply-adds counted from an MXNet symbol, this core's measured
float32 peak, the check that one thread ran, and the check that a figure is not above what one core can do.

- count_macs(sym, {"data": (1, 3, 224, 224)}): multiply-adds of Convolution (with groups), Deconvolution and
  FullyConnected layers, from the shapes infer_shape gives; FLOPs = 2 x MACs. Everything else (BatchNorm,
  activations, pooling, element-wise sums, bias adds) is not counted, and named in the result.
- measure_peak(): the best GFLOP/s of a large float32 matrix product on this thread, through MXNet's mx.nd.dot
  (its OpenBLAS), MXNet's FullyConnected (oneDNN, which runs the convolutions too) and numpy's BLAS.
- one_thread(): OMP_NUM_THREADS=1 and every OpenMP runtime in the process at 1 thread, else BenchError.
- Meter: the process's CPU seconds over wall seconds of a timed loop (more than 1 = more than one core ran).
- judge(...): a per-core figure above PEAK_MARGIN x the measured peak, or from a loop that used more than
  PEAK_MARGIN cores, is INVALID, with the reason.

MXNet is imported inside the functions that need it: a benchmark fixes its threads before it loads.
"""
import ctypes
import json
import os
import time

from bench.common import BenchError, md_table

COUNTED = ("Convolution", "Deconvolution", "FullyConnected")
PEAK_MARGIN = 1.1  # a per-core figure above 1.1x the measured single-core peak did not come from one core
SHARED_BELOW = 0.9  # a loop that got less of its core than this shared it with another process: it understates
PEAK_N, PEAK_REPEATS = 2048, 5


# -- multiply-adds ---------------------------------------------------------------------------------
def _prod(shape):
    n = 1
    for s in shape:
        n *= int(s)
    return n


def count_macs(sym, input_shapes):
    """Multiply-adds of one forward of `sym` with inputs of input_shapes ({name: shape}, batch included).

    Convolution: output elements x (input channels / groups) x kernel size (the weight's shape after its
    first axis, so groups and 1-D/3-D kernels count right). Deconvolution: input elements x the weight's
    shape after its first axis. FullyConnected: output elements x input features.
    Returns {"macs", "by_op": {op: MACs}, "layers": {op: count}, "uncounted": {op: count}}.
    """
    nodes = json.loads(sym.tojson())["nodes"]
    internals = sym.get_internals()
    try:
        arg_shapes, out_shapes, aux_shapes = internals.infer_shape(**input_shapes)
    except Exception as e:  # MXNetError: a shape the network cannot take
        raise BenchError(f"cannot infer the network's shapes for inputs {input_shapes}: {str(e).splitlines()[0]}") \
            from None
    if out_shapes is None:
        raise BenchError(f"inputs {input_shapes} do not fix every shape of the network: name all of its inputs")
    shapes = dict(zip(internals.list_outputs(), out_shapes))
    shapes.update(zip(internals.list_arguments(), arg_shapes))
    shapes.update(zip(internals.list_auxiliary_states(), aux_shapes))

    def shape_of(entry):
        node, index = nodes[entry[0]], entry[1]
        name = node["name"]
        for key in ((name,) if node["op"] == "null" else (f"{name}_output", f"{name}_output{index}")):
            if key in shapes:
                return shapes[key]
        raise BenchError(f"no inferred shape for output {index} of node {name!r}")

    macs, by_op, layers, uncounted = 0, {}, {}, {}
    for i, node in enumerate(nodes):
        op = node["op"]
        if op == "null":
            continue
        if op not in COUNTED:
            uncounted[op] = uncounted.get(op, 0) + 1
            continue
        weight = shape_of(node["inputs"][1])
        if op == "Convolution":
            n = _prod(shape_of([i, 0, 0])) * _prod(weight[1:])
        elif op == "Deconvolution":
            n = _prod(shape_of(node["inputs"][0])) * _prod(weight[1:])
        else:  # FullyConnected: weight (hidden, features)
            n = _prod(shape_of([i, 0, 0])) * int(weight[1])
        macs += n
        by_op[op] = by_op.get(op, 0) + n
        layers[op] = layers.get(op, 0) + 1
    return {"macs": macs, "by_op": by_op, "layers": layers, "uncounted": uncounted}


def macs_per_image(sym, input_shape, input_name="data"):
    """count_macs for one image of input_shape (C, H, W)."""
    return count_macs(sym, {input_name: (1, *input_shape)})


def gluon_symbol(net, input_name="data"):
    """The symbol graph of a Gluon HybridBlock (what it exports), for count_macs."""
    import mxnet as mx
    out = net(mx.sym.var(input_name))
    return out[0] if isinstance(out, (list, tuple)) else out


# -- this core's peak -----------------------------------------------------------------------------
class Meter:
    """CPU seconds of this process (every thread) and wall seconds between start() and stop()."""

    def start(self):
        self.cpu0, self.wall0 = time.process_time(), time.perf_counter()
        return self

    def stop(self):
        self.wall = time.perf_counter() - self.wall0
        self.cpu = time.process_time() - self.cpu0
        self.cores = self.cpu / self.wall if self.wall > 0 else 0.0
        return self


def _best_gemm(fn, flop, repeats):
    fn()  # warm-up: first-touch of the output, BLAS start-up
    runs = []
    for _ in range(repeats):
        m = Meter().start()
        fn()
        m.stop()
        runs.append({"gflops": flop / m.wall / 1e9, "gflops_cpu": flop / max(m.cpu, 1e-9) / 1e9, "cores": m.cores})
    best = max(runs, key=lambda r: r["gflops"])
    return {"gflops": best["gflops"], "cores_used": best["cores"], "all_gflops": [r["gflops"] for r in runs],
            "gflops_cpu": max(r["gflops_cpu"] for r in runs), "cores_used_max": max(r["cores"] for r in runs),
            "cores_used_min": min(r["cores"] for r in runs)}


def measure_peak(n=PEAK_N, repeats=PEAK_REPEATS):
    """This thread's practical float32 peak: the best of `repeats` n x n x n matrix products (2 n^3 FLOPs)
    through mx.nd.dot (MXNet's BLAS), mx.nd.FullyConnected (oneDNN) and numpy's BLAS. "gflops" is the best of
    them, per wall second or
    per CPU second of the process (the same on an idle core; per CPU second, a product that shared its core
    with another process still tells what the core does); "gflops_wall" per wall second alone. A product
    that ran on more than PEAK_MARGIN cores is refused: a peak from several threads would excuse any figure."""
    import mxnet as mx
    import numpy as np
    rng = np.random.default_rng(0)
    a, b = (rng.random((n, n), dtype=np.float32) for _ in range(2))
    am, bm = mx.nd.array(a), mx.nd.array(b)
    flop = 2.0 * n ** 3
    # NOTE: the BLAS is not the core's peak everywhere. Where OPENBLAS_CORETYPE names an older core (Haswell on an
    # AVX-512 EPYC here), mx.nd.dot and numpy run AVX2 kernels at half of what oneDNN's AVX-512 kernels reach, and
    # the teachers' convolutions (oneDNN) measured 1.4-1.9x that "peak". oneDNN's inner product is the same
    # n x n x n product through the library the teachers run on.
    res = {"mx.nd.dot": _best_gemm(lambda: mx.nd.dot(am, bm).wait_to_read(), flop, repeats),
           "mx.nd.FullyConnected": _best_gemm(
               lambda: mx.nd.FullyConnected(am, bm, no_bias=True, num_hidden=n).wait_to_read(), flop, repeats),
           "numpy": _best_gemm(lambda: a @ b, flop, repeats)}
    for name, r in res.items():
        # Judged on the run that used the fewest cores: a BLAS on several threads uses them in every run, while
        # a moment of another thread of this process (MXNet's engine after the product before) lands in one run,
        # and on a 0.5 ms product (n = 256) put it at 1.17 cores.
        if r["cores_used_min"] > PEAK_MARGIN:
            raise BenchError(f"the peak's {name} product used {r['cores_used_min']:.2f} cores, not one: a BLAS ran on "
                             f"several threads (OMP_NUM_THREADS / OPENBLAS_NUM_THREADS must be 1 before numpy and "
                             f"MXNet load)")
    best = {k: max(r["gflops"], r["gflops_cpu"]) for k, r in res.items()}
    source = max(best, key=best.get)
    return {"gflops": best[source], "source": source, "gflops_wall": max(r["gflops"] for r in res.values()),
            "n": n, "repeats": repeats, **res}


def peak_line(peak, cpu):
    """One line naming the peak, how it was measured and on what."""
    fc = peak.get("mx.nd.FullyConnected") or {"gflops": float("nan"), "gflops_cpu": float("nan")}  # older reports
    return (f"Measured peak: {peak['gflops']:.1f} GFLOP/s per core (float32 {peak['n']}x{peak['n']} matrix product, "
            f"one thread, best of {peak['repeats']}: mx.nd.dot {peak['mx.nd.dot']['gflops']:.1f}, oneDNN's "
            f"FullyConnected {fc['gflops']:.1f}, numpy's BLAS {peak['numpy']['gflops']:.1f} per wall second; best per "
            f"CPU second {peak['mx.nd.dot']['gflops_cpu']:.1f}, {fc['gflops_cpu']:.1f}, "
            f"{peak['numpy']['gflops_cpu']:.1f}) on {cpu_text(cpu)}.")


# -- one thread, one core ---------------------------------------------------------------------------
def _openmp_runtimes():
    """Paths of the OpenMP runtimes mapped into this process (MXNet's libgomp, and any other's)."""
    try:
        with open("/proc/self/maps") as fh:
            paths = {ln.split()[-1] for ln in fh if ln.rstrip().endswith(".so") or ".so." in ln}
    except OSError:
        return []
    return sorted(p for p in paths if os.path.basename(p).startswith(("libgomp", "libiomp", "libomp")))


def process_threads():
    try:
        with open("/proc/self/status") as fh:
            return next(int(ln.split()[1]) for ln in fh if ln.startswith("Threads:"))
    except (OSError, StopIteration, ValueError):
        return None


def one_thread():
    """Check that this process computes on one thread: OMP_NUM_THREADS=1 and every loaded OpenMP runtime's
    omp_get_max_threads() = 1 (call after MXNet is imported). Returns what it saw; BenchError if not."""
    seen = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"), "omp_max_threads": {},
            "threads_in_process": process_threads()}
    if seen["OMP_NUM_THREADS"] != "1":
        raise BenchError(f"OMP_NUM_THREADS is {seen['OMP_NUM_THREADS']!r}, not 1: set it before MXNet is imported "
                         f"(bench.common.limit_threads)")
    for path in _openmp_runtimes():
        try:
            n = int(ctypes.CDLL(path).omp_get_max_threads())
        except (OSError, AttributeError):
            continue
        seen["omp_max_threads"][os.path.basename(path)] = n
        if n != 1:
            raise BenchError(f"{path} runs {n} OpenMP threads although OMP_NUM_THREADS=1: it was loaded before "
                             f"the variable was set")
    return seen


def cpu_id():
    """The CPU as /proc/cpuinfo names it (the model name alone, "AMD EPYC", names no generation)."""
    info = {}
    try:
        with open("/proc/cpuinfo") as fh:
            for ln in fh:
                if not ln.strip():
                    break  # the first CPU is enough
                k, _, v = ln.partition(":")
                info[k.strip()] = v.strip()
    except OSError:
        pass
    flags = set(info.get("flags", "").split())
    return {"model_name": info.get("model name", ""), "family": info.get("cpu family"), "model": info.get("model"),
            "stepping": info.get("stepping"), "mhz_reported": info.get("cpu MHz"),
            "simd": [f for f in ("avx2", "fma", "avx512f", "avx512_vnni", "amx_tile") if f in flags],
            "cpus": os.cpu_count()}


def cpu_text(c):
    ident = f"family {c['family']} model {c['model']} stepping {c['stepping']}" if c["family"] else "unknown family"
    return f"{c['model_name'] or 'CPU'} ({ident}; {'+'.join(c['simd']) or 'no AVX2'}; {c['cpus']} CPUs)"


# -- the check and the table -------------------------------------------------------------------------
def judge(gflops, peak_gflops, cores_used):
    """"" for a figure one core can have produced, else why it is INVALID."""
    why = []
    if cores_used is not None and cores_used > PEAK_MARGIN:
        why.append(f"the timed loop used {cores_used:.2f} cores (CPU s / wall s): more than one thread ran")
    if gflops > PEAK_MARGIN * peak_gflops:
        why.append(f"{gflops:.1f} GFLOP/s is above {PEAK_MARGIN}x the measured single-core peak "
                   f"({peak_gflops:.1f}): more than one thread ran, or the multiply-add count is wrong")
    return "; ".join(why)


def teacher_figures(name, input_shape, macs, images_per_s, cores_used, peak):
    """The JSON row of one teacher: GFLOP per image (2 x MACs), GFLOP/s per core, its fraction of the peak,
    and `invalid` (why) when one core cannot have produced it. peak: measure_peak()'s result."""
    gflop = 2.0 * macs / 1e9
    gflops = gflop * images_per_s
    return {"teacher": name, "input_shape": list(input_shape), "macs_per_image": int(macs),
            "gflop_per_image": gflop, "images_per_s_per_core": images_per_s, "gflops_per_core": gflops,
            "fraction_of_peak": gflops / peak["gflops"], "cores_used": cores_used,
            "shared_core": cores_used is not None and cores_used < SHARED_BELOW,
            "invalid": judge(gflops, peak["gflops"], cores_used)}


def gflops_table(rows):
    """Markdown: teacher, input, GFLOP per image, images/s, GFLOP/s per core, fraction of the peak; a row that
    failed the check shows INVALID in place of its figures, one whose loop shared its core says so."""
    out = []
    for r in rows:
        shape = "x".join(map(str, r["input_shape"]))
        cores = f"{r['cores_used']:.2f}" + (" (shared core: understates)" if r.get("shared_core") else "")
        if r["invalid"]:
            out.append([r["teacher"], shape, f"{r['gflop_per_image']:.4g}", "INVALID", "INVALID", "INVALID", cores])
        else:
            out.append([r["teacher"], shape, f"{r['gflop_per_image']:.4g}", f"{r['images_per_s_per_core']:,.1f}",
                        f"{r['gflops_per_core']:.1f}", f"{r['fraction_of_peak']:.2f}", cores])
    return md_table(["teacher", "input (CxHxW)", "GFLOP per image (2 x MACs)", "images/s per core",
                     "GFLOP/s per core", "fraction of measured peak", "cores used (CPU s / wall s)"], out)


def invalid_lines(rows):
    return [f"INVALID: {r['teacher']}: {r['invalid']}" for r in rows if r["invalid"]]
