"""Publishing a finished cache (a folder, a web server, object storage) and receiving it, checked, by its fingerprint.

    publish(cache, dest)   the cache's file unchanged, manifest.json and a README.md card (kdcache publish)
    pull(src)              fetched, resumed, checked and installed in the cache directory (kdcache pull)

Folders need nothing more; URLs need fsspec (and aiohttp for http:// and https://): pip install 'kdcache[share]'.
"""
from .manifest import ShareError
from .publish import publish
from .pull import pull

__all__ = ["publish", "pull", "ShareError"]
