"""The training loop on the Hugging Face Trainer (trainer.py) and the run directory it writes (run_dir.py)."""
