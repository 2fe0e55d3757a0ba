"""Pre-training data: corpus readers, the token cache, run inputs and their fingerprints, masking."""
