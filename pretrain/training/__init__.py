"""The training loop and what it needs: run directory and lock, finite guard, data order, optimizer and precision, checkpoints, distributed helpers."""
