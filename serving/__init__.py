"""Serving: user entry points over the model (`python -m serving.generate`)."""
