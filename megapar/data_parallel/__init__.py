"""Data parallelism: bucketed, overlapped gradient averaging over the dp group."""

from megapar.data_parallel.buckets import Bucket, GradBuckets, make_buckets

__all__ = ["Bucket", "GradBuckets", "make_buckets"]
