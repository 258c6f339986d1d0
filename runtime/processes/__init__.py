"""The processes that run schedulers: one per rank (scheduler_process), the tensor-parallel leader and followers
(tensor_parallel), and the data-parallel router over replicas (data_parallel)."""
