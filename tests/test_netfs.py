"""A cache directory on a network file system (NFS, SMB, sshfs, ...) is recognised from the mount table,
and a reader following a cache that is still being written there is warned once: HDF5 SWMR does not
work on network file systems (finished caches and per-host shards do)."""
import logging

import numpy as np
import pytest

from kdcache.store import CacheReader, CacheWriter, osutil, path_for
from tests.helpers import expected_logits, make_spec

MOUNTS = r"""22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
36 22 0:32 / /mnt/data rw,relatime shared:7 - nfs4 server:/export rw,vers=4.2,addr=10.0.0.2
40 36 8:17 / /mnt/data/local rw,relatime shared:9 - ext4 /dev/sdb1 rw
41 22 0:51 / /home/u/my\040files rw,nosuid shared:11 - fuse.sshfs u@host:/ rw,user_id=1000
42 22 0:52 / /srv/share rw - cifs //nas/share rw,vers=3.1.1
43 22 0:53 / /scratch rw - lustre 10.0.0.3@tcp:/scratch rw
44 22 0:54 / /tmp rw - tmpfs tmpfs rw
"""


@pytest.fixture
def mountinfo(tmp_path, monkeypatch):
    path = tmp_path / "mountinfo"
    path.write_text(MOUNTS)
    monkeypatch.setattr(osutil, "_warned_mounts", set())
    return str(path)


@pytest.mark.parametrize("path,want", [
    ("/mnt/data/caches", ("/mnt/data", "nfs4")),
    ("/mnt/data", ("/mnt/data", "nfs4")),
    ("/mnt/data/local/caches", None),  # a local disk mounted inside the NFS share
    ("/mnt/database/caches", None),  # a prefix of the name is not the mount
    ("/home/u/my files/caches", ("/home/u/my files", "fuse.sshfs")),  # \040 in the table
    ("/srv/share/kd/caches", ("/srv/share", "cifs")),
    ("/scratch/caches", None),  # Lustre: POSIX semantics
    ("/home/u/caches", None),
])
def test_network_file_systems_are_recognised_from_the_mount_table(mountinfo, path, want):
    assert osutil.network_filesystem(path, mountinfo) == want


def test_no_mount_table_is_no_network_file_system(tmp_path):
    assert osutil.network_filesystem("/mnt/data", str(tmp_path / "missing")) is None
    assert osutil.mount_of(str(tmp_path)) is not None  # this machine's own table reads


def test_the_warning_is_given_once_per_mount(mountinfo, caplog):
    caplog.set_level(logging.WARNING, logger="kdcache.store")
    assert osutil.warn_if_network("/mnt/data/a", mountinfo) and osutil.warn_if_network("/mnt/data/b", mountinfo)
    assert not osutil.warn_if_network("/home/u/caches", mountinfo)
    warnings = [r.getMessage() for r in caplog.records if r.name == "kdcache.store"]
    assert len(warnings) == 1
    for words in ("/mnt/data/a", "nfs4", "being written", "finished caches read fine", "--shard", "local --cache-dir"):
        assert words in warnings[0], warnings[0]


def test_a_reader_following_a_live_cache_on_nfs_is_warned_and_a_finished_one_is_not(tmp_path, monkeypatch, caplog):
    table = tmp_path / "mountinfo"
    table.write_text("36 1 0:32 / / rw - nfs4 server:/export rw\n")  # everything on NFS
    monkeypatch.setattr(osutil, "MOUNTINFO", str(table))
    monkeypatch.setattr(osutil, "_warned_mounts", set())
    caplog.set_level(logging.WARNING, logger="kdcache.store")
    spec = make_spec(num_samples=20)
    base = path_for(str(tmp_path / "caches"), spec.fingerprint)
    w = CacheWriter(base, spec)
    w.write(np.arange(5), expected_logits(np.arange(5), spec.num_classes))
    CacheReader(base).close()  # following the writer
    assert sum("network file system" in r.getMessage() for r in caplog.records) == 1
    w.write(np.arange(5, 20), expected_logits(np.arange(5, 20), spec.num_classes))
    assert w.close()
    caplog.clear()
    monkeypatch.setattr(osutil, "_warned_mounts", set())
    CacheReader(base).close()  # finished: fine on NFS
    assert not any("network file system" in r.getMessage() for r in caplog.records)
