"""Publishing a finished cache (a folder, a web server, object storage) and receiving it, checked, by its fingerprint.

    kdcache.share.publish.publish(cache, dest)   the cache's file unchanged, manifest.json and a README.md card
    kdcache.share.pull.pull(src)                 fetched, resumed, checked and installed in the cache directory

(`kdcache.publish` and `kdcache.pull` are these two; `kdcache publish` and `kdcache pull` their commands.) Folders
need nothing more; URLs need fsspec (and aiohttp for http:// and https://): pip install 'kdcache[share]'.
"""
from .manifest import ShareError

__all__ = ["ShareError"]
