"""Photos from files at 224 px: decode ms per image, and the producer's images/s with decode workers against the teacher alone.

    python -m bench.decode [--quick] [--out bench/results/decode.json]

The photos: PHOTOS JPEGs of 300-500 px made from real photographs available offline: the colour
JPEGs of the Debian package opencv-doc (/usr/share/doc/opencv-doc/examples/data/*.jpg) and the
two scikit-learn ships (china.jpg, flower.jpg). Photo i is a crop of source i mod S (its area
30-100% of the source's, aspect 3/4-4/3, drawn from numpy's Generator seeded [SEED, i]), rescaled
(Lanczos) so that its longer side is 300-500 px (drawn too), and encoded as JPEG at quality
QUALITY; class = source mod 10, root/train/c<class>/<i>.jpg. Deterministic byte for byte.

Teachers: Gluon model-zoo architectures (mobilenet1.0, resnet18_v1) with random weights (speed does
not depend on weights; nothing is downloaded), exported to checkpoint files, 224x224 inputs. The
producer (python -m kdcache.cache_builder, offline) reads the folder with --image-size 256x256 and
--augment center:224 (short side 256, centre crop 224), batch 32, the teacher on THREADS thread(s);
it is timed with 0 decode workers (decoding in series) and with the workers the cores left give
(at least 1). The teacher alone runs the same checkpoint on pre-decoded tensors, same threads and
batch, once by itself and once beside a process that makes views as a decode worker does (on shared
cores that is the most a producer with one worker can reach). Each configuration runs REPEATS
times, interleaved, and the best is kept. Each figure stands beside the CPU model, the cores, this
core's measured float32 peak and the load average before and after the run.
"""
