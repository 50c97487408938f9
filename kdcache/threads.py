"""The compute threads of a kdcache process, fixed before MXNet loads.

NOTE (threads). Only environment variables read when libmxnet.so loads limit MXNet's threads:
OMP_NUM_THREADS its operators' OpenMP threads, OPENCV_FOR_THREADS_NUM the thread pool of the OpenCV
built into it (image decoding and resizing: mx.image.imread, imresize). OpenCV's pool is as large as
the machine, and its idle workers wait actively (sched_yield in a loop): a decode process meant
for one core used ~1.5 (measured: CPU time 1.45-1.6x its wall time decoding photos, 1.01x with the
pool at 1), the extra half taken from the teacher's core beside it. Both are set to the process's
own share of the cores, as one budget.
"""
import os


def fix_threads(n=None):
    """MXNet's and its OpenCV's threads at n (left as the environment says when n is None); MXNet's
    subgraph messages off unless asked for. Call before anything imports MXNet."""
    if n:
        os.environ["OMP_NUM_THREADS"] = str(n)
        os.environ["OPENCV_FOR_THREADS_NUM"] = str(n)
    os.environ.setdefault("MXNET_SUBGRAPH_VERBOSE", "0")
