"""lrdsl's version: stamped into every generated module and its cache key."""
__version__ = "0.1.0"
