"""Pre-training model parts: the decoder and objective heads (Hugging Face models), losses, the unpadded encoder path."""
