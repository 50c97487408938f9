"""The KD loss's defaults, GluonCV's (DistillationSoftmaxCrossEntropyLoss: temperature 20, hard-label weight
0.5): KDLoss, kd_symbol and the trainer's --temperature and --alpha all take them from here. No MXNet: the
command line reads them before MXNet loads."""

DEFAULT_TEMPERATURE = 20.0
DEFAULT_ALPHA = 0.5  # the soft term's weight; 1 - alpha weighs the hard labels
