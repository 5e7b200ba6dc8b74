"""Helpers for other libraries' checkpoints, each in its own module with its own optional
dependencies (extra ``hf``):

- :mod:`integrity_fs.integrations.transformers`: a ``transformers.Trainer`` callback that seals each
  ``checkpoint-N`` folder, and the newest verified one to resume from;
- :mod:`integrity_fs.integrations.safetensors`: a sealed directory's safetensors file(s) loaded into
  a state dict, each byte read once and verified before any tensor is returned.

Nothing is imported here: ``import integrity_fs`` never imports torch or transformers.
"""

__all__ = ()  # the modules are imported by name, each with its own dependencies
