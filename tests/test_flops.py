"""bench.flops: multiply-adds counted from MXNet symbols match hand counts and published ones; a per-core figure
one core cannot produce is refused; a thread limit set too late is caught."""
import json
import os
import subprocess
import sys

import pytest

mx = pytest.importorskip("mxnet")

from bench.common import BenchError  # noqa: E402
from bench.flops import (PEAK_MARGIN, count_macs, gflops_table, gluon_symbol, invalid_lines, judge,  # noqa: E402
    macs_per_image, one_thread, teacher_figures)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
data = mx.sym.var("data")


def macs(sym, shape):
    return count_macs(sym, {"data": shape})["macs"]


def test_convolution_counts_output_elements_times_kernel_volume():
    conv = mx.sym.Convolution(data, kernel=(3, 3), num_filter=4, pad=(1, 1), name="c")
    assert macs(conv, (1, 3, 8, 8)) == 4 * 8 * 8 * (3 * 3 * 3)  # 6,912
    strided = mx.sym.Convolution(data, kernel=(3, 3), num_filter=4, stride=(2, 2), no_bias=True, name="s")
    assert macs(strided, (1, 3, 9, 9)) == 4 * 4 * 4 * (3 * 3 * 3)  # output 4x4
    assert macs(conv, (5, 3, 8, 8)) == 5 * 6912  # the batch multiplies
    assert count_macs(conv, {"data": (1, 3, 8, 8)})["layers"] == {"Convolution": 1}


def test_grouped_and_depthwise_convolution_count_channels_per_group():
    grouped = mx.sym.Convolution(data, kernel=(3, 3), num_filter=8, num_group=4, name="g")
    assert macs(grouped, (1, 8, 10, 10)) == 8 * 8 * 8 * (8 // 4) * 9  # 9,216
    depthwise = mx.sym.Convolution(data, kernel=(3, 3), num_filter=8, num_group=8, pad=(1, 1), name="d")
    assert macs(depthwise, (1, 8, 10, 10)) == 8 * 10 * 10 * 1 * 9  # 7,200: one input channel per filter


def test_dense_and_deconvolution():
    fc = mx.sym.FullyConnected(data, num_hidden=5, name="fc")  # flattens 2x3x4 = 24 features
    assert macs(fc, (3, 2, 3, 4)) == 3 * 5 * 24
    fc_seq = mx.sym.FullyConnected(data, num_hidden=5, flatten=False, name="fs")  # per position: 7 x 6 -> 7 x 5
    assert macs(fc_seq, (1, 7, 6)) == 7 * 5 * 6
    deconv = mx.sym.Deconvolution(data, kernel=(3, 3), num_filter=6, stride=(2, 2), name="dc")
    assert macs(deconv, (1, 4, 5, 5)) == 4 * 5 * 5 * 6 * 9  # every input element meets 6 x 3 x 3 weights


def test_a_network_sums_its_layers_and_names_what_it_leaves_out():
    x = mx.sym.Convolution(data, kernel=(3, 3), num_filter=4, pad=(1, 1), name="c1")
    x = mx.sym.BatchNorm(x, name="bn")
    x = mx.sym.Activation(x, act_type="relu", name="r")
    x = mx.sym.Pooling(x, kernel=(2, 2), stride=(2, 2), pool_type="max", name="p")
    x = mx.sym.FullyConnected(x, num_hidden=10, name="fc")
    r = count_macs(x, {"data": (1, 3, 8, 8)})
    assert r["by_op"] == {"Convolution": 6912, "FullyConnected": 10 * 4 * 4 * 4}
    assert r["macs"] == 6912 + 640
    assert r["uncounted"] == {"BatchNorm": 1, "Activation": 1, "Pooling": 1}


def test_a_shape_the_network_cannot_take_is_one_error():
    fc = mx.sym.FullyConnected(mx.sym.Convolution(data, kernel=(5, 5), num_filter=2, name="c"), num_hidden=3)
    with pytest.raises(BenchError, match="cannot infer"):
        count_macs(fc, {"data": (1, 3, 4, 4)})  # a 5x5 kernel on 4x4


@pytest.mark.parametrize("name, published", [
    ("resnet18_v1", 1.82e9),   # He et al. 2016, Table 1: 1.8 x 10^9; 1.82 GMACs as profilers count it
    ("mobilenet1.0", 569e6),   # Howard et al. 2017, Table 8: 569 million mult-adds
])
def test_model_zoo_networks_match_their_published_multiply_adds(name, published):
    from mxnet.gluon.model_zoo import vision
    r = macs_per_image(gluon_symbol(vision.get_model(name, classes=1000)), (3, 224, 224))
    assert r["macs"] == pytest.approx(published, rel=0.02), r
    features = 512 if "resnet" in name else 1024
    assert r["layers"]["FullyConnected"] == 1 and r["by_op"]["FullyConnected"] == features * 1000


def test_a_figure_above_the_measured_peak_is_invalid():
    peak = 80.0
    assert judge(peak, peak, 1.0) == ""
    assert judge(PEAK_MARGIN * peak * 0.99, peak, 0.98) == ""
    assert "above 1.1x the measured single-core peak" in judge(PEAK_MARGIN * peak * 1.01, peak, 1.0)
    assert "used 1.90 cores" in judge(40.0, peak, 1.9)  # a loop on two threads, even below the peak
    # The README's old ResNet-18 figure (41.6 images/s at 3.63 GFLOP an image) on a core that peaks at 85
    row = teacher_figures("resnet18_v1", (3, 224, 224), 1_814_073_344, 41.6, 1.0, {"gflops": 85.0})
    assert row["gflops_per_core"] == pytest.approx(150.9, abs=0.1) and row["invalid"]
    ok = teacher_figures("resnet18_v1", (3, 224, 224), 1_814_073_344, 17.0, 0.99, {"gflops": 85.0})
    assert ok["invalid"] == "" and ok["fraction_of_peak"] == pytest.approx(17.0 * 3.628148688 / 85.0)
    table = gflops_table([row, ok])
    bad_line, ok_line = table.splitlines()[2:]
    assert "INVALID" in bad_line and "150.9" not in bad_line and "INVALID" not in ok_line
    assert invalid_lines([row, ok]) == [f"INVALID: resnet18_v1: {row['invalid']}"]
    # a loop that got half its core (another process ran) is valid but marked: it understates the core
    shared = teacher_figures("resnet18_v1", (3, 224, 224), 1_814_073_344, 10.5, 0.49, {"gflops": 85.0})
    assert shared["invalid"] == "" and shared["shared_core"] and "shared core" in gflops_table([shared])
    assert not ok["shared_core"] and "shared core" not in ok_line


def test_one_thread_refuses_another_omp_setting(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    with pytest.raises(BenchError, match="OMP_NUM_THREADS is '4'"):
        one_thread()


@pytest.mark.parametrize("omp_at_import, ok", [("1", True), ("2", False)])
def test_one_thread_reads_mxnets_openmp_runtime(omp_at_import, ok):
    """The limit must be set before MXNet loads: set after, the environment says 1 and the runtime runs 2."""
    code = ("import os, json, mxnet; os.environ['OMP_NUM_THREADS'] = '1'\n"
            "from bench.flops import measure_peak, one_thread\n"
            "print(json.dumps(one_thread()['omp_max_threads']))\n"
            "print(json.dumps(measure_peak(n=256, repeats=2)))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": omp_at_import,
                            "MXNET_SUBGRAPH_VERBOSE": "0"})
    if ok:
        assert r.returncode == 0, r.stderr[-2000:]
        seen, peak = (json.loads(line) for line in r.stdout.strip().splitlines()[-2:])
        assert any("gomp" in lib for lib in seen) and set(seen.values()) == {1}
        # the peak: the best of the three products (BLAS, oneDNN, numpy) per wall or CPU second, from one thread
        assert peak["source"] in ("mx.nd.dot", "mx.nd.FullyConnected", "numpy") and peak["n"] == 256
        assert peak["gflops"] == max(max(peak[k]["gflops"], peak[k]["gflops_cpu"]) for k in ("mx.nd.dot", "mx.nd.FullyConnected",
                                                                                     "numpy"))
        assert peak["gflops"] >= peak["gflops_wall"] > 0
    else:
        assert r.returncode != 0 and "runs 2 OpenMP threads although OMP_NUM_THREADS=1" in r.stderr


@pytest.mark.parametrize("cores, refused", [([2.0, 2.0, 2.0], True), ([1.0, 1.3, 1.0], False)])
def test_the_peak_refuses_a_product_on_several_threads_not_a_moment_of_another_thread(monkeypatch, cores, refused):
    """Several BLAS threads use them in every run: refused. Another thread of the process busy during one
    run (MXNet's engine after the product before) makes that run read high: the peak still stands."""
    from bench import flops
    seq = iter(cores * 3 * 4)  # every product's runs read these, in turn

    class Fake(flops.Meter):
        def stop(self):
            super().stop()
            self.cores = next(seq)
            return self

    monkeypatch.setattr(flops, "Meter", Fake)
    if refused:
        with pytest.raises(BenchError, match="cores, not one"):
            flops.measure_peak(n=64, repeats=3)
    else:
        assert flops.measure_peak(n=64, repeats=3)["gflops"] > 0
