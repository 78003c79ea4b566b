"""Tensor parallelism: the target sharded over ranks, one process each (transformers' own tensor-parallel plans
over torch.distributed). Rank 0 schedules, drafts, verifies and samples; it tells the other ranks every target
forward before running it, and they run the same one. It imports worker and types."""
