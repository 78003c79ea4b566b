"""Where the lossless tests run the engine: the CPU in float32 unless ``SPECD_TEST_DEVICE`` says otherwise.

``SPECD_TEST_DEVICE=cuda`` (what benchmarks/gpu/run.sh sets) runs them on a GPU in bfloat16, CUDA graphs and all,
against the same float32 reference on the CPU; ``SPECD_TEST_DTYPE`` overrides the dtype.
"""

from __future__ import annotations

import os

DEVICE = os.environ.get("SPECD_TEST_DEVICE", "cpu")
DTYPE = os.environ.get("SPECD_TEST_DTYPE", "bfloat16" if DEVICE.startswith("cuda") else "float32")

# Top-2 logit gap of the float32 reference under which the engine's argmax may legitimately differ from it.
# float32 kernels differ from the reference's in summation order alone (~1e-6). bfloat16 rounds every product to 8
# significant bits: on the tiny test models (logits within +-1.3) its logits differed from float32's by up to 0.006
# (measured over 6 architectures, 320 positions each); 0.02 leaves three times that.
NEAR_TIE = {"float32": 1e-4, "bfloat16": 0.02, "float16": 0.02}[DTYPE]

_CUDA = DEVICE.startswith("cuda")
# Engine arguments of a greedy test. On CUDA each engine captures a graph per bucket (about six a second), and the
# buckets grow with max_num_seqs: the greedy tests batch at most 8 sequences.
GREEDY_ENGINE = {"device": DEVICE, "dtype": DTYPE, **({"max_num_seqs": 8} if _CUDA else {})}
# The sampled tests run 512 sequences at once to draw their samples: graphs for every batch bucket up to 512 would
# take minutes to capture, and what they check is the acceptance rule, not the graphs (the greedy tests cover those).
SAMPLED_ENGINE = {"device": DEVICE, **({"cuda_graphs": False} if _CUDA else {})}
