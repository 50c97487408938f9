"""The input pipeline both sides share: data sets, keyed augmentation views and the schedule."""
from .augment import Augment, make_views
from .datasets import DATASETS, DatasetError, load_dataset
from .schedule import epoch_batches, epoch_permutation, schedule, view_of_epoch

__all__ = ["Augment", "make_views", "DATASETS", "DatasetError", "load_dataset", "epoch_batches",
           "epoch_permutation", "schedule", "view_of_epoch"]
