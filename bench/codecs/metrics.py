"""How far a codec's rebuilt soft targets are from the teacher's: T^2 * KL, the ideal top-K, top-1 agreement;
and the synthetic 1000-class case's teacher (the generator's own posterior, as an MXNet checkpoint)."""
import numpy as np

from kdcache.store.format.codec import log_tail_mass

TEMPERATURES = (1, 4, 20)
CHUNK = 2048  # rows at a time: 1000 classes in float64 stay small


def _log_softmax(x):
    x = x - x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


def kd_distance(z, r, t):
    """Mean over rows of T^2 * KL(softmax(z/T) || softmax(r/T)): the KD loss's soft term between the
    teacher's logits z and the logits r a codec gives back (0 when r is z)."""
    total = 0.0
    for a in range(0, len(z), CHUNK):
        lp = _log_softmax(z[a:a + CHUNK].astype(np.float64) / t)
        lq = _log_softmax(r[a:a + CHUNK].astype(np.float64) / t)
        total += float((np.exp(lp) * (lp - lq)).sum())
    return t * t * total / len(z)


def ideal_topk(z, k):
    """The best a top-K codec with an even tail can do: the K largest logits exact (float64) and the
    exact probability mass of the other C-K classes spread evenly over them."""
    z = z.astype(np.float64)
    c = z.shape[1]
    idx = np.argpartition(-z, k - 1, axis=1)[:, :k]
    out = np.empty_like(z)
    if k < c:
        m = z.max(axis=1)
        lse = m + np.log(np.exp(z - m[:, None]).sum(axis=1))
        out[...] = (lse + log_tail_mass(z, idx, lse) - np.log(c - k))[:, None]
    np.put_along_axis(out, idx, np.take_along_axis(z, idx, axis=1), axis=1)
    return out


def top1_agreement(z, r):
    """Fraction of rows whose largest rebuilt logit is the teacher's top class."""
    return float((r.argmax(axis=1) == z.argmax(axis=1)).mean())


def codec_distances(z, r, k=None):
    """{"kl": {T: value}, "ideal": {T: value}, "ratio": {T: kl / ideal}} (ideal and ratio for top-K only)."""
    out = {"kl": {str(t): kd_distance(z, r, t) for t in TEMPERATURES}, "top1_agreement": top1_agreement(z, r)}
    if k is not None:
        ideal = ideal_topk(z, k)
        out["ideal"] = {str(t): kd_distance(z, ideal, t) for t in TEMPERATURES}
        out["ratio"] = {t: (out["kl"][t] / v if v > 0 else None) for t, v in out["ideal"].items()}
    return out


# --- the synthetic case's teacher --------------------------------------------------------------
# pipeline.datasets.load_synthetic draws class prototypes uniform in [40, 215] per pixel (generator
# [seed, 0]) and adds Gaussian noise of std 45 before clipping to [0, 255]. For that model the
# Bayes posterior is linear in the pixels: log p(c | x) = (x . mu_c - |mu_c|^2 / 2) / sigma^2 + const.
PROTO_LOW, PROTO_HIGH, NOISE_STD = 40.0, 215.0, 45.0


def posterior_weights(classes, shape, seed):
    """(W [classes, pixels], b [classes]) of the posterior's logits for images scaled to [0, 1]."""
    d = int(np.prod(shape))
    mu = np.random.default_rng([seed, 0]).uniform(PROTO_LOW, PROTO_HIGH, size=(classes, d)).astype(np.float32)
    mu = mu.astype(np.float64)
    return 255.0 * mu / NOISE_STD ** 2, -0.5 * (mu ** 2).sum(axis=1) / NOISE_STD ** 2


def posterior_teacher(prefix, classes, shape, seed):
    """Export the synthetic data's near-Bayes teacher (Flatten + Dense with posterior_weights) as
    PREFIX-symbol.json / PREFIX-0000.params. Imports MXNet: call it after the threads are fixed."""
    import mxnet as mx
    from mxnet import gluon
    w, b = posterior_weights(classes, shape, seed)
    net = gluon.nn.HybridSequential(prefix="posterior_")
    with net.name_scope():
        net.add(gluon.nn.Flatten(), gluon.nn.Dense(classes, in_units=w.shape[1]))
    net.initialize()
    net[1].weight.set_data(mx.nd.array(w.astype(np.float32)))
    net[1].bias.set_data(mx.nd.array(b.astype(np.float32)))
    net.hybridize()
    net(mx.nd.zeros((1,) + tuple(shape)))
    net.export(prefix, epoch=0)
    return prefix
