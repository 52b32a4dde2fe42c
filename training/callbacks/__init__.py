"""The training callbacks, one module each; configs/callbacks/ builds them."""
