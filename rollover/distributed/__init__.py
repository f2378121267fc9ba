"""Training on several ranks: FSDP2 over PyTorch distributed, one command channel from rank 0."""
