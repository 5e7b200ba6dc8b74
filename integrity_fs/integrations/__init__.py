"""Helpers for other libraries' checkpoints, each in its own module with its own optional
dependencies (extra ``hf``): :mod:`.transformers` (a ``Trainer`` callback, the newest verified
checkpoint to resume from) and :mod:`.safetensors` (a sealed directory's tensors, verified)."""

__all__: list[str] = []
