"""The KD loss's defaults, GluonCV's (DistillationSoftmaxCrossEntropyLoss: temperature 20, hard-label weight
0.5): KDLoss, kd_symbol and the trainer's --temperature and --alpha all take them from here, and the label
smoothing's allowed values. No MXNet: the command line reads them before MXNet loads."""

from kdcache.args import Float

DEFAULT_TEMPERATURE = 20.0
DEFAULT_ALPHA = 0.5  # the soft term's weight; 1 - alpha weighs the hard labels
# The hard-label term's label smoothing: eps in [0, 1), 0 (none) by default (--label-smoothing, KDLoss, kd_symbol)
SMOOTHING = Float(0, 1, lt=True)
