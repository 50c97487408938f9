"""kdcache: knowledge distillation without paying for the teacher over and over.

The packages: store (the soft-target cache), cache_builder (the CPU teacher producer), trainer
(the student), pipeline (data sets, views, the schedule, the teacher runner). `kdcache` is the
command line of all of them (kdcache.cli).
"""
__version__ = "0.2.0"
