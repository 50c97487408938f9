"""A run distilling from a `sampled:K` codec at a temperature other than 1 says so in one line at its start:
the codec's rows are an unbiased estimate of the teacher at T = 1 (docs/codecs.md), and at the default
T = 20 the student learns that estimate tempered, which is neither. At T = 1, and for other codecs, nothing
is said. An ensemble member of that codec is named with its own temperature."""
import os
import subprocess
import sys

from kdcache.trainer.options import sampled_warning
from tests.helpers import CHILD_ENV


def warnings(stderr):
    return [ln for ln in stderr.splitlines() if "warning:" in ln]


def test_kdcache_train_warns_once_at_the_start_and_only_off_t_1(tmp_path, teacher):
    kd = os.path.join(os.path.dirname(sys.executable), "kdcache")

    def train(*extra):
        return subprocess.run([kd, "train", "--teacher", teacher, "--dataset", "digits", "--codec", "sampled:8",
                               "--epochs", "1", "--quiet", *extra], cwd=tmp_path, env=CHILD_ENV, capture_output=True,
                              text=True, timeout=600)
    r = train("--run", "default-t")  # T = 20, the default
    assert r.returncode == 0, r.stderr[-3000:]
    (line,) = warnings(r.stderr)
    assert "codec sampled:8" in line and "--temperature 20" in line and "pass -T 1" in line, line
    first = [ln for ln in r.stderr.splitlines() if ln.startswith("[trainer")][0]
    assert "warning:" in first, "said at the start, before the data set is loaded"
    r = train("--run", "t-1", "-T", "1")
    assert r.returncode == 0 and not warnings(r.stderr), r.stderr[-3000:]


def test_the_line_names_what_tempers_the_estimate():
    assert sampled_warning("topk:5", 20) is None and sampled_warning("full", 4) is None
    assert sampled_warning("sampled:8", 1) is None and sampled_warning("sampled:8", 1, member=("m", 1)) is None
    line = sampled_warning("sampled:16", 4, member=("caches/ab12", 2))
    assert "\n" not in line and "ensemble member caches/ab12 (codec sampled:16)" in line
    assert "its own T 2 and --temperature 4" in line and "pass -T 1 and give the member T 1" in line
    line = sampled_warning("sampled:16", 1, member=("caches/ab12", 2))
    assert "pass -T 1" not in line and "give the member T 1" in line
