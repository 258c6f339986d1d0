"""LoRA adapters on the shared linears: PEFT loading (adapter.py), the shrink/expand ops (ops.py) and the per-batch
adapter selection wired through `Linear` (manager.py)."""
