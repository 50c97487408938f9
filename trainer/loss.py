"""The KD loss: alpha * T^2 * KL(softmax(t/T) || softmax(s/T)) + (1 - alpha) * CE(s, y).

Targets are the teacher's raw logits (temperature 1, as cached), so one cache serves every
temperature. GluonCV's DistillationSoftmaxCrossEntropyLoss uses T=20 and hard weight 0.5.
"""
from mxnet import gluon


class KDLoss(gluon.loss.Loss):
    """Per-sample KD loss from student logits, teacher logits and hard labels.

    alpha=0 gives plain cross-entropy on the labels (no teacher); alpha=1 the soft term only.
    """

    def __init__(self, temperature=20.0, alpha=0.5, **kw):
        super().__init__(weight=None, batch_axis=0, **kw)
        self.temperature = float(temperature)
        self.alpha = float(alpha)

    def hybrid_forward(self, F, student, teacher, label):
        t = self.temperature
        ce = -F.pick(F.log_softmax(student, axis=1), label, axis=1)
        if self.alpha == 0:
            return ce
        log_ps = F.log_softmax(student / t, axis=1)
        log_pt = F.log_softmax(teacher / t, axis=1)
        kl = F.sum(F.exp(log_pt) * (log_pt - log_ps), axis=1)
        return self.alpha * t * t * kl + (1.0 - self.alpha) * ce
