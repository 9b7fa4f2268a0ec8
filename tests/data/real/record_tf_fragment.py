"""A fragmentation out-of-memory error from TensorFlow's BFC allocator: free bytes exceed the
request, but no free chunk is large enough and the limit leaves no room for a new region.

Usage: record_tf_fragment.py LIMIT_MB DUMP_PREFIX. Fills the pool with 1 MiB tensors, frees
every other one, then asks for 3 MiB (run with TF_CPU_ALLOCATOR_USE_BFC=true, as the other
scripts here)."""
import os, sys
os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
os.environ["TF_CPU_BFC_MEM_LIMIT_IN_MB"] = sys.argv[1]
os.environ["TF_BFC_MEMORY_DUMP"] = sys.argv[2]
import tensorflow as tf
live = []
try:
    while True:
        live.append(tf.raw_ops.Empty(shape=tf.constant([1 << 20]), dtype=tf.uint8))
except tf.errors.ResourceExhaustedError:
    pass
print("filled with", len(live), "tensors of 1 MiB")
del live[::2]                      # every other one: free memory in 1 MiB holes
try:
    big = tf.raw_ops.Empty(shape=tf.constant([3 << 20]), dtype=tf.uint8)
    print("no oom")
except tf.errors.ResourceExhaustedError:
    print("OOM with", len(live), "tensors live")
