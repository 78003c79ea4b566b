"""What runs inside a forward: paged attention (registered with transformers' AttentionInterface), its CPU
kernel (``kernels/paged_attention.cpp``), the KV cache tensors, small linear layers, and the tracing flag.

May import types/ only."""
