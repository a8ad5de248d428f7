"""Data parallelism: the gradient synchronisation over the dp group (`grad_sync.GradSync`,
one kind per ZeRO stage, chosen by `build_grad_sync`)."""

from megapar.data_parallel.buckets import Bucket, GradBuckets, make_buckets
from megapar.data_parallel.grad_sync import GradSync, build_grad_sync

__all__ = ["Bucket", "GradBuckets", "GradSync", "build_grad_sync", "make_buckets"]
