"""Benchmarks for integrity_fs: ``python -m benchmarks [--quick] [--write]``.

Every contender runs in its own child process (``benchmarks.runner``) on the same bytes, so
that its peak RSS is its own; see README.md in this folder.
"""
