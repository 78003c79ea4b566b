"""Running a model: loading a transformers causal LM, its packed and paged forward, static buckets and CUDA
graphs, torch.compile and its warm-up, the host side of a forward's layout and its upload.

May import models/, layers/ and types/; never sample/, speculative/, core/ or the face."""
